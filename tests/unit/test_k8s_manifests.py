"""`unbroken k8s render`: manifests valid against the JobSet CRD's and Kubernetes' schemas, offline,
for 1, 8 and 1,024 replica groups; the commands they run are the ones the CLI parses; bad settings
are refused saying what to fix; the committed Kustomize base is what the renderer renders."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

import unbroken
from unbroken.cli import main
from unbroken.k8s import commands, render
from unbroken.k8s.k8s_settings import COORDINATOR_JOB, GROUPS_JOB, SPARES_JOB, K8sSettings

ROOT = Path(unbroken.__file__).parent.parent
BASE = ROOT / "deploy" / "kubernetes"
# The command the committed base was rendered with (docs/kubernetes.md says the same).
BASE_ARGS = ["--image", "registry.example.com/your-team/train:latest", "--replicas", "2", "--spares", "1"]


def _validate() -> Any:
    pytest.importorskip("jsonschema", reason="the [k8s] extra is not installed (pip install -e '.[k8s]')")
    pytest.importorskip("kubernetes_validate", reason="the [k8s] extra is not installed (pip install -e '.[k8s]')")
    from unbroken.k8s import validate

    return validate


def settings(**kw: Any) -> K8sSettings:
    return K8sSettings(**{"image": "registry.example.com/train:1", "command": ("python", "train.py"), **kw})


def _jobset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "JobSet")


def _rjob(js: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in js["spec"]["replicatedJobs"] if r["name"] == name)


def _container(rjob: dict[str, Any]) -> dict[str, Any]:
    return rjob["template"]["spec"]["template"]["spec"]["containers"][0]


SHAPES = [
    pytest.param(dict(replicas=1), id="1-group"),
    pytest.param(dict(replicas=8, spares=2, restart_job_gate=True), id="8-groups-gate"),
    pytest.param(dict(replicas=8, nodes_per_replica=4, ranks_per_replica=32, gpus_per_node=8), id="8-groups-4-nodes"),
    pytest.param(dict(replicas=1024, spares=16, restart_job_gate=True), id="1024-groups-gate"),
    pytest.param(dict(replicas=1024, nodes_per_replica=2, ranks_per_replica=16), id="1024-groups-2-nodes"),
    pytest.param(dict(replicas=8, hot_spares=2), id="8-groups-2-hot-spares"),
]


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_manifests_are_valid(shape: dict[str, Any], version: str) -> None:
    validate = _validate()
    s = settings(**shape)
    objects = render.render(s)
    assert validate.check(objects, s.restart_job_gate, version) == []
    js = _jobset(objects)
    assert _rjob(js, GROUPS_JOB)["replicas"] == s.replicas
    assert _rjob(js, GROUPS_JOB)["template"]["spec"]["completions"] == s.nodes_per_replica
    assert (SPARES_JOB in {r["name"] for r in js["spec"]["replicatedJobs"]}) == bool(s.spare_groups)


def test_validation_catches_what_the_api_server_and_the_webhook_would_refuse() -> None:
    """The checks can fail: a field no schema names, an action JobSet does not know, RestartJob
    on a cluster without the gate, a rule aimed at a replicated job that does not exist."""
    validate = _validate()
    s = settings(replicas=4, restart_job_gate=True)
    objects = render.render(s)
    js = _jobset(objects)
    _container(_rjob(js, GROUPS_JOB))["cmd"] = ["python"]  # a typo of command
    js["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartEverything"
    js["spec"]["failurePolicy"]["rules"][2]["targetReplicatedJobs"] = ["coordinators"]
    problems = validate.check(objects, restart_job_gate=False)
    text = "\n".join(problems)
    assert "'cmd' was unexpected" in text
    assert "'RestartEverything' is not one of" in text
    assert "needs the RestartJob feature gate" in text
    assert "'coordinators', which is not a replicatedJob" in text
    service = next(o for o in objects if o["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "http"
    assert any(p.startswith("Service ") for p in validate.check([service], False))


def test_restart_job_beyond_1024_child_jobs_is_refused_by_the_settings_and_the_webhook_check() -> None:
    with pytest.raises(ValueError, match="at most 1024 child Jobs per replicated job.*--nodes-per-replica"):
        settings(replicas=1025, restart_job_gate=True)
    validate = _validate()
    objects = render.render(settings(replicas=1025))  # without the gate: valid
    assert validate.check(objects, False) == []
    js = _jobset(objects)
    js["spec"]["failurePolicy"]["rules"][1]["action"] = "RestartJob"
    assert any("at most 1024 replicas" in p for p in validate.check(objects, True))


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(name="Unbroken_Job"), "DNS-1035 label"),
        (dict(name="a" * 50), "shorten it to at most"),
        (dict(replicas=0), "--replicas must be at least 1"),
        (dict(min_replicas=5, replicas=4), r"--min-replicas must be in \[1, --replicas=4\]"),
        (dict(nodes_per_replica=3, ranks_per_replica=8), "positive multiple of --nodes-per-replica"),
        (dict(port=9400, http_port=9400), "must differ"),
        (dict(term_grace_s=40.0), "terminationGracePeriodSeconds"),
        (dict(image=" "), "--image is empty"),
        (dict(command=()), "training command"),
    ],
)
def test_bad_settings_say_what_to_fix(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        settings(**kw)


def _expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's expansion of $(VAR) in a container's command."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in argv]


def flags(argv: list[str]) -> set[str]:
    """The options an argv uses (before the worker's own command)."""
    return {a for a in argv[: argv.index("--")] if a.startswith("--")}


def _parse(command: click.Command, argv: list[str]) -> dict[str, Any]:
    ctx = command.make_context(argv[0], argv[1:])
    return dict(ctx.params)


def test_the_pods_commands_are_what_the_real_cli_parses() -> None:
    """The rendered argv goes through the real `unbroken agent` and `unbroken coordinator` option
    parsers (as the pod's `unbroken` would run it), with the values the settings asked for."""
    from unbroken.control.coordinator_cli import coordinator
    from unbroken.launch.node.agent_cli import agent

    s = settings(replicas=8, nodes_per_replica=2, ranks_per_replica=16, spares=1)
    js = _jobset(render.render(s))
    argv = _container(_rjob(js, COORDINATOR_JOB))["command"]
    assert argv[:2] == ["unbroken", "coordinator"]
    p = _parse(coordinator, argv[1:])
    assert (p["replicas"], p["min_replicas"], p["port"], p["http_port"]) == (8, 5, s.port, s.http_port)
    assert p["standby"] and str(p["secret_file"]) == render.KEY_FILE and str(p["state_dir"]) == render.STATE_DIR
    for rjob in (GROUPS_JOB, SPARES_JOB):
        argv = _container(_rjob(js, rjob))["command"]
        names = {e["name"] for e in _container(_rjob(js, rjob))["env"]}
        assert {"POD_NAME", "POD_IP"} <= names  # every $(VAR) the kubelet must expand is defined
        argv = _expand(argv, {"POD_NAME": "unbroken-groups-3-1-x7k2q", "POD_IP": "10.4.0.17"})
        p = _parse(agent, argv[1:])
        assert p["coordinator"] == ",".join(s.coordinator_addresses())
        assert (p["node"], p["advertise_addr"], p["slots"]) == ("unbroken-groups-3-1-x7k2q", "10.4.0.17", 1)
        assert (p["ranks_per_replica"], p["nodes_per_replica"]) == (16, 2)
        assert list(p["command"]) == ["python", "train.py"]


def test_hot_spares_run_in_the_spares_job_and_the_coordinator_is_told() -> None:
    from unbroken.control.coordinator_cli import coordinator

    s = settings(replicas=8, spares=1, hot_spares=2)
    js = _jobset(render.render(s))
    assert _rjob(js, SPARES_JOB)["replicas"] == 3  # a free slot's agent, and two hot spares' agents
    p = _parse(coordinator, _container(_rjob(js, COORDINATOR_JOB))["command"][1:])
    assert (p["replicas"], p["hot_spares"]) == (8, 2)
    assert _validate().check(render.render(s), s.restart_job_gate) == []
    with pytest.raises(ValueError, match="--hot-spares must be 0 or more"):
        settings(hot_spares=-1)


def test_the_box_runs_the_same_command_lines(tmp_path: Path) -> None:
    """The cluster box's agent and coordinator argv come from the same builder as the pods': the
    box's, parsed, differ from the pods' only in where things are (addresses, paths)."""
    from unbroken.cluster.job import PROG, BoxJob, JobSpec
    from unbroken.control.coordinator_cli import coordinator
    from unbroken.launch.node.agent_cli import agent

    host = SimpleNamespace(addr="198.18.0.1", addr2="198.19.0.1")
    job = BoxJob(SimpleNamespace(host=lambda name: host), tmp_path, JobSpec(replicas=3, min_replicas=2))
    box_agent = job.agent_argv("h0")
    rebuilt = commands.agent_argv(
        PROG,
        commands.AgentArgs(
            coordinators=(job.address,),
            node="h0",
            run_dir=str(tmp_path),
            secret_file=str(job.secret_file),
            connect_timeout_s=60,
        ),
        job.worker_argv(),
    )
    assert box_agent == rebuilt
    box = _parse(agent, box_agent[len(PROG) :])
    pod = _parse(agent, _expand(render.agent_args(settings(replicas=3)), {"POD_NAME": "p", "POD_IP": "10.0.0.1"})[1:])
    same = ("ranks_per_replica", "nodes_per_replica", "relay", "max_restarts", "backoff")
    assert {k: box[k] for k in same} == {k: pod[k] for k in same}
    # What the pods add to the box's command lines, and nothing else: the standby, the key's file,
    # the dashboard, the no-progress bound; the slot, the pod's address, the SIGTERM grace.
    pod_c = render.coordinator_args(settings(replicas=3))
    _parse(coordinator, job.coordinator_argv()[len(PROG) :])
    extra = {a for a in pod_c if a.startswith("--")} - {a for a in job.coordinator_argv() if a.startswith("--")}
    assert extra == {"--standby", "--secret-file", "--http-port", "--no-progress-timeout"}
    pod_a = render.agent_args(settings(replicas=3))
    assert flags(pod_a) - flags(box_agent) == {"--slots", "--advertise-addr", "--term-grace-s"}
    assert flags(box_agent) <= flags(pod_a)


def test_the_key_is_only_referenced_and_its_mounted_file_loads(tmp_path: Path) -> None:
    """No Secret (and so no key) in the manifests: the pods mount the Secret by name, read-only
    for its owner, which is what JobSecret.load accepts; the kubelet's layout (a symlink through
    ..data) is followed."""
    from unbroken.wire.auth import JobSecret

    s = settings(replicas=2)
    objects = render.render(s)
    assert "Secret" not in {o["kind"] for o in objects}
    volume = _jobset(objects)["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == s.secret
    key = JobSecret.generate()
    text = render_text(s)
    assert key.key.hex() not in text and base64.b64encode(key.key.hex().encode()).decode() not in text
    # the kubelet's projection: <dir>/..2026_11_29/secret, <dir>/..data -> it, <dir>/secret -> ..data/secret
    mount = tmp_path / "etc-unbroken"
    data = mount / "..2026_11_29_12_00_00.1"
    data.mkdir(parents=True)
    (data / "secret").write_text(key.key.hex() + "\n")
    os.chmod(data / "secret", volume["secret"]["defaultMode"])
    (mount / "..data").symlink_to(data.name)
    (mount / "secret").symlink_to("..data/secret")
    assert JobSecret.load(mount / "secret").key == key.key
    os.chmod(data / "secret", 0o440)  # what an fsGroup would make it: refused, saying why
    with pytest.raises(Exception, match="readable by others"):
        JobSecret.load(mount / "secret")


def render_text(s: K8sSettings) -> str:
    from unbroken.k8s.k8s_cli import header, to_yaml

    return header(s) + to_yaml(render.render(s))


def test_the_dashboard_service_is_scraped_and_selects_the_coordinator() -> None:
    s = settings()
    objects = render.render(s)
    dash = next(o for o in objects if o["metadata"]["name"] == f"{s.name}-dashboard")
    assert dash["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert dash["metadata"]["annotations"]["prometheus.io/port"] == str(s.http_port)
    assert dash["spec"]["selector"][render.REPLICATED_JOB_LABEL] == COORDINATOR_JOB
    probe = _container(_rjob(_jobset(objects), COORDINATOR_JOB))["readinessProbe"]
    assert probe["tcpSocket"]["port"] == s.http_port  # only the serving coordinator opens it


def test_render_command_writes_yaml_and_refuses_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["k8s", "render", "--image", "img:1", "--replicas", "3", "--", "python", "t.py"])
    assert out.exit_code == 0, out.output
    docs = [d for d in yaml.safe_load_all(out.output) if d]
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Service", "Service", "JobSet"]
    assert "kubectl create secret generic unbroken-key --from-file=secret=" in out.output
    bad = runner.invoke(main, ["k8s", "render", "--image", "img:1", "--replicas", "0", "--", "python", "t.py"])
    assert bad.exit_code == 2 and "--replicas must be at least 1" in bad.output


def test_the_committed_kustomize_base_is_what_render_renders(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        main, ["k8s", "render", *BASE_ARGS, "--kustomize", str(tmp_path), "--", "python", "train.py"]
    )
    assert out.exit_code == 0, out.output
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in BASE.iterdir()}
    assert committed == fresh, "deploy/kubernetes is stale: rerun the command in docs/kubernetes.md"
    kustomization = yaml.safe_load(fresh["kustomization.yaml"])
    assert sorted(kustomization["resources"]) == sorted(n for n in fresh if n != "kustomization.yaml")


def test_kubectl_kustomize_builds_the_base_where_kubectl_is_installed() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here: `kubectl kustomize deploy/kubernetes` is not run")
    done = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(done.stdout) if d)
    assert kinds == ["JobSet", "PersistentVolumeClaim", "Service", "Service"]
