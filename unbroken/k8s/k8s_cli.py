"""``unbroken k8s render``: a job's JobSet, Services and state claim, as YAML or a Kustomize base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from unbroken.extras import MissingExtra
from unbroken.k8s import render as rendering
from unbroken.k8s.k8s_settings import K8sSettings


def header(s: K8sSettings) -> str:
    """The comment the YAML starts with: what to create first, and how (the key is never here)."""
    ns = f" -n {s.namespace}" if s.namespace else ""
    gate = " with its RestartJob feature gate on" if s.restart_job_gate else ""
    return (
        "# Rendered by `unbroken k8s render`; see docs/kubernetes.md. The job key is not in this file:\n"
        "#   unbroken secret new job.key\n"
        f"#   kubectl{ns} create secret generic {s.secret} --from-file=secret=job.key\n"
        f"# Needs JobSet (jobset.x-k8s.io/v1alpha2, v0.12 or later){gate}.\n"
    )


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.safe_dump(o, sort_keys=False, width=120) for o in objects)


def _file_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_base(directory: Path, s: K8sSettings, objects: list[dict[str, Any]]) -> list[Path]:
    """A Kustomize base: one file per object and a ``kustomization.yaml`` listing them."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for obj in objects:
        path = directory / _file_name(obj)
        path.write_text(header(s) + to_yaml([obj]))
        written.append(path)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [p.name for p in written],
    }
    path = directory / "kustomization.yaml"
    note = (
        "# Rendered by `unbroken k8s render --kustomize`. Set the namespace here or in an overlay;\n"
        "# rename with `unbroken k8s render --name` (not namePrefix: the pods' commands name each other).\n"
    )
    path.write_text(note + yaml.safe_dump(kustomization, sort_keys=False))
    return [*written, path]


@click.group()
def k8s() -> None:
    """Kubernetes: a JobSet whose child Jobs are the replica groups (docs/kubernetes.md)."""


@k8s.command(context_settings={"ignore_unknown_options": True})
@click.option("--image", required=True, help="The container image with unbroken and the training script.")
@click.option("--name", default="unbroken", show_default=True, help="The JobSet's name (a DNS-1035 label).")
@click.option("--namespace", default=None, help="The namespace of every object [default: kubectl's].")
@click.option("--replicas", type=int, default=2, show_default=True, help="Replica groups (one child Job each).")
@click.option("--min-replicas", type=int, default=None, help="Fewest replicas that may train [default: a majority].")
@click.option("--spares", type=int, default=0, show_default=True, help="Spare groups: agents with a free slot.")
@click.option(
    "--hot-spares",
    type=int,
    default=0,
    show_default=True,
    help="Hot spare groups: replicas that wait, model built, for a lost one's place (coordinator --hot-spares).",
)
@click.option("--nodes-per-replica", type=int, default=1, show_default=True, help="Pods (nodes) per replica group.")
@click.option("--ranks-per-replica", type=int, default=1, show_default=True, help="Ranks per group, over its pods.")
@click.option("--gpus-per-node", type=int, default=0, show_default=True, help="nvidia.com/gpu each agent pod requests.")
@click.option("--port", type=int, default=29510, show_default=True, help="The coordinator's port.")
@click.option("--http-port", type=int, default=9400, show_default=True, help="The dashboard's and /metrics' port.")
@click.option("--heartbeat-timeout", type=float, default=2.0, show_default=True)
@click.option("--startup-window", type=float, default=20.0, show_default=True)
@click.option("--no-progress-timeout", type=float, default=900.0, show_default=True)
@click.option(
    "--restart-job-gate",
    is_flag=True,
    help="The cluster's JobSet runs with --feature-gates=RestartJob=true: a failed group's child Job is "
    "recreated alone (RestartJob). Without it a group's pods are replaced one by one and its Job never fails.",
)
@click.option("--max-restarts", type=int, default=100, show_default=True, help="JobSet's failurePolicy.maxRestarts.")
@click.option("--secret-name", default=None, help="The Secret holding the job key [default: NAME-key].")
@click.option("--state-claim", default=None, help="The ReadWriteMany claim for state and logs [default: NAME-state].")
@click.option("--state-claim-size", default="10Gi", show_default=True)
@click.option("--storage-class", default=None, help="The claim's storage class (one with ReadWriteMany).")
@click.option("--no-state-claim", is_flag=True, help="Do not emit the claim (it exists already).")
@click.option("--kustomize", "base", type=click.Path(path_type=Path), default=None, help="Write a Kustomize base here.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the YAML here [default: stdout].")
@click.option("--validate", "check", is_flag=True, help="Check against the vendored schemas (needs the [k8s] extra).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def render(
    image: str,
    name: str,
    namespace: str | None,
    replicas: int,
    min_replicas: int | None,
    spares: int,
    hot_spares: int,
    nodes_per_replica: int,
    ranks_per_replica: int,
    gpus_per_node: int,
    port: int,
    http_port: int,
    heartbeat_timeout: float,
    startup_window: float,
    no_progress_timeout: float,
    restart_job_gate: bool,
    max_restarts: int,
    secret_name: str | None,
    state_claim: str | None,
    state_claim_size: str,
    storage_class: str | None,
    no_state_claim: bool,
    base: Path | None,
    out: Path | None,
    check: bool,
    command: tuple[str, ...],
) -> None:
    """Render a job's manifests: `unbroken k8s render --image IMG --replicas 8 -- python train.py`."""
    if command and command[0] == "--":
        command = command[1:]
    try:
        s = K8sSettings(
            image=image,
            command=command,
            name=name,
            namespace=namespace,
            replicas=replicas,
            min_replicas=min_replicas,
            spares=spares,
            hot_spares=hot_spares,
            nodes_per_replica=nodes_per_replica,
            ranks_per_replica=ranks_per_replica,
            gpus_per_node=gpus_per_node,
            port=port,
            http_port=http_port,
            heartbeat_timeout_s=heartbeat_timeout,
            startup_window_s=startup_window,
            no_progress_timeout_s=no_progress_timeout,
            restart_job_gate=restart_job_gate,
            max_restarts=max_restarts,
            secret_name=secret_name,
            state_claim=state_claim,
            state_claim_size=state_claim_size,
            storage_class=storage_class,
            emit_state_claim=not no_state_claim,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    objects = rendering.render(s)
    if check:
        from unbroken.k8s import validate

        try:
            problems = validate.check(objects, restart_job_gate)
        except MissingExtra as e:
            raise click.ClickException(str(e)) from e
        if problems:
            raise click.ClickException("the rendered manifests are not valid:\n" + "\n".join(problems))
        click.echo(
            f"valid: {len(objects)} objects (JobSet v1alpha2 v0.12 schema, Kubernetes {validate.K8S_VERSION})", err=True
        )
    if base is not None:
        for path in write_base(base, s, objects):
            click.echo(str(path), err=True)
        return
    text = header(s) + to_yaml(objects)
    if out is not None:
        out.write_text(text)
    else:
        click.echo(text, nl=False)
