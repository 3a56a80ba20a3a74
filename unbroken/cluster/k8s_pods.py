"""The rendered Kubernetes pods, run in the cluster box (``unbroken bench cluster --scenario kubernetes``).

Each pod of :func:`unbroken.k8s.render.render` becomes a host of the box, as a pod is a network
namespace of its own: the container's ``command`` and ``env`` exactly as rendered, with what the
cluster would supply filled in as the kubelet and the cluster's DNS would fill it in:

* ``$(POD_NAME)``, ``$(POD_IP)`` and the downward API's fields (the pod's name with a random
  suffix, the host's address, the completion index and job index);
* the pods' DNS names (``NAME-coordinator-0-0.NAME``) resolved to the hosts' addresses;
* the state claim (``/unbroken``) as one directory every host shares, the Secret's mount
  (``/etc/unbroken``) as the kubelet projects it (``secret -> ..data/secret``, mode 0400);
* ``unbroken`` as ``python -m unbroken``.

The scenario: the two coordinator pods (both ``--standby``; the first to lock serves), two
replica groups and a spare. A group's pod loses power: its replica moves to the spare and catches
up, and the Job's replacement pod (a new name) joins as the new spare. Then the serving
coordinator's pod loses power: the standby takes over and training goes on to the end.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.cluster.box import Box
from unbroken.cluster.job import BoxJob, JobSpec, consistency, wait_until
from unbroken.config import ENV_PYTHONPATH, executable_path, python_path
from unbroken.k8s import render
from unbroken.k8s.k8s_settings import COORDINATOR_JOB, GROUPS_JOB, SPARES_JOB, K8sSettings, pod_hostname
from unbroken.observe.events import read_events
from unbroken.wire.auth import JobSecret

CAP = 100_000  # the workers' --steps: the run ends by its stop file


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of ``$(VAR)`` in a container's command."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


class Pods:
    """The rendered pods of ``settings`` in ``box``; the shared claim and the key under ``root``."""

    def __init__(self, box: Box, root: Path, settings: K8sSettings) -> None:
        self.box, self.root, self.s = box, root, settings
        self.volume = root / "volume"
        (self.volume / "run").mkdir(parents=True, exist_ok=True)
        self.key = JobSecret.generate()
        self.jobset = render.jobset(settings)
        self.procs: dict[str, Any] = {}
        self.dns: dict[str, str] = {}  # pod hostname -> the box host's address
        self.names: dict[str, str] = {}  # box host -> the pod name it runs now
        self._made = 0
        base = str(Path(__file__).resolve().parents[2])
        self.base_env = {
            "PATH": executable_path(),
            ENV_PYTHONPATH: os.pathsep.join(filter(None, [base, python_path()])),
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
        }

    def _key_mount(self, pod: str) -> Path:
        """The Secret's volume as the kubelet projects it into ``pod``."""
        mount = self.root / f"key-{pod}"
        data = mount / "..2026_01_01_00_00_00.000000001"
        data.mkdir(parents=True)
        (data / "secret").write_text(self.key.key.hex() + "\n")
        os.chmod(data / "secret", render.KEY_MODE)
        (mount / "..data").symlink_to(data.name)
        (mount / "secret").symlink_to("..data/secret")
        return mount

    def _template(self, rjob: str) -> dict[str, Any]:
        r = next(r for r in self.jobset["spec"]["replicatedJobs"] if r["name"] == rjob)
        return r["template"]["spec"]["template"]["spec"]["containers"][0]

    def resolve_at(self, rjob: str, job_index: int, pod_index: int, host: str) -> None:
        """The cluster's DNS: the pod's stable name (JobSet's headless Service) is ``host``'s address."""
        self.dns[f"{pod_hostname(self.s.name, rjob, job_index, pod_index)}.{self.s.name}"] = self.box.host(host).addr

    def start(self, rjob: str, job_index: int, host: str, pod_index: int = 0) -> str:
        """Starts the pod (a new one: a new name) on ``host``; returns its name."""
        self._made += 1
        pod = f"{pod_hostname(self.s.name, rjob, job_index, pod_index)}-{self._made:05d}"
        container = self._template(rjob)
        fields = {
            "metadata.name": pod,
            "status.podIP": self.box.host(host).addr,
            f"metadata.annotations['{render.COMPLETION_INDEX_ANNOTATION}']": str(pod_index),
            f"metadata.labels['{render.JOB_INDEX_LABEL}']": str(job_index),
        }
        env = dict(self.base_env)
        for var in container.get("env", []):
            env[var["name"]] = var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        argv = [self._resolve(expand(str(a), env), pod) for a in container["command"]]
        assert argv[0] == "unbroken", argv
        argv = [sys.executable, "-m", "unbroken", *argv[1:]]
        self.procs[pod] = self.box.spawn(host, argv, self.root / f"{pod}.log", env)
        self.names[host] = pod
        return pod

    def _resolve(self, arg: str, pod: str) -> str:
        """One argument as the pod sees it: DNS names to addresses, the mounts to their directories."""
        for name, addr in self.dns.items():
            arg = arg.replace(name, addr)
        for mount, local in ((render.KEY_DIR, lambda: self._key_dir(pod)), (render.VOLUME_DIR, lambda: self.volume)):
            if arg == mount or arg.startswith(mount + "/"):
                return str(local()) + arg[len(mount) :]
        return arg

    def _key_dir(self, pod: str) -> Path:
        mount = self.root / f"key-{pod}"
        return mount if mount.exists() else self._key_mount(pod)


class PodsJob(BoxJob):
    """BoxJob's readers (metrics, finals, the stop file) over the pods' shared claim; the
    coordinator's events are in its state directory."""

    def __init__(self, box: Box, pods: Pods, replicas: int) -> None:
        super().__init__(box, pods.volume / "run", JobSpec(replicas=replicas, min_replicas=1, steps=CAP))
        self.state_dir = pods.volume / "state"

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.state_dir / "events.jsonl") if kind is None or e["kind"] == kind]


def worker_command(run_dir: Path) -> tuple[str, ...]:
    """The box's worker, as the pods' training command."""
    return (
        sys.executable,
        "-m",
        "unbroken.cluster.worker",
        "--steps",
        str(CAP),
        "--width",
        "128",
        "--pace-s",
        "0.1",
        "--stop-file",
        str(run_dir / "stop-at"),
    )


def kubernetes_pods(root: Path, quick: bool = False) -> dict[str, Any]:
    tail = 5 if quick else 30
    root = root / "kubernetes"
    root.mkdir(parents=True, exist_ok=True)
    s = K8sSettings(
        image="box",
        command=worker_command(root / "volume" / "run"),
        replicas=2,
        min_replicas=1,
        spares=1,
        startup_window_s=3,
        connect_timeout_s=60,
        emit_state_claim=False,
    )
    t_start = time.time()
    with Box(4) as box:  # ctl, h0: the coordinator's two pods; h1, h2: the groups; h3: the spare
        pods = Pods(box, root, s)
        job = PodsJob(box, pods, s.replicas)
        for i, host in enumerate(("ctl", "h0")):
            pods.resolve_at(COORDINATOR_JOB, 0, i, host)
        coordinator_0 = pods.procs[pods.start(COORDINATOR_JOB, 0, "ctl", pod_index=0)]
        wait_until("the first coordinator to serve", lambda: job.events("coordinator_started"), 60)
        pods.start(COORDINATOR_JOB, 0, "h0", pod_index=1)
        shapes = {"h1": (GROUPS_JOB, 0), "h2": (GROUPS_JOB, 1), "h3": (SPARES_JOB, 0)}
        agents = {h: pods.start(rjob, index, h) for h, (rjob, index) in shapes.items()}
        wait_until("3 agents to join", lambda: len(job.events("agent_joined")) >= 3, 120)
        # The coordinator, not the JobSet, says which agent runs which replica (in the order they
        # joined): the spare is the agent given none, whichever child Job its pod belongs to.
        joined = {e["node"]: e["replicas"] for e in job.events("agent_joined")}
        spare = next(n for n, r in joined.items() if not r)
        lost = next(n for n, r in joined.items() if r == [1])
        lost_host = next(h for h, p in agents.items() if p == lost)
        job.wait_for_step(1, 8, 180)
        t0 = time.time()
        box.power_cut(lost_host)
        moved = wait_until(
            "the replica on the spare",
            lambda: [e for e in job.events("replica_reassigned") if e["replica"] == 1],
            90,
        )
        replacement = pods.start(*shapes[lost_host], lost_host)  # the Job's new pod: a new name, the new spare
        wait_until(
            "the replacement pod to join", lambda: any(e["node"] == replacement for e in job.events("agent_joined")), 90
        )
        wait_until("replica 1 to catch up", lambda: any(1 in q["behind"] for q in job.events("quorum")), 120)
        step_before = max(job.step_of(0), job.step_of(1))
        t1 = time.time()
        box.power_cut("ctl")  # the serving coordinator's pod
        wait_until("the standby to take over", lambda: len(job.events("coordinator_started")) >= 2, 60)
        job.wait_for_step(0, step_before + 5, 120)
        job.finish_in(tail)
        alive = [h for h in ("h1", "h2", "h3") if h != lost_host] + [lost_host]
        codes = {h: _wait(pods.procs[pods.names[h]], 120) for h in alive}
    ev = job.events()
    t_detect = next((e["t"] for e in ev if e["t"] >= t0 and e["kind"] == "replica_evicted" and e["replica"] == 1), None)
    t_back = next((e["t"] for e in ev if e["t"] >= t0 and e["kind"] == "quorum" and 1 in e["behind"]), None)
    t_takeover = [e["t"] for e in ev if e["kind"] == "coordinator_started"][-1]
    inv = consistency(job, [0, 1])
    checks = {
        "agents_finished": all(c == 0 for c in codes.values()),
        "moved_to_spare": moved[0]["to_node"] == spare,
        "standby_took_over": coordinator_0.poll() is not None and t_takeover >= t1,
        **{k: v for k, v in inv.items() if isinstance(v, bool)},
    }
    return {
        "scenario": "kubernetes",
        "passed": all(checks.values()),
        "checks": checks,
        "detection_s": None if t_detect is None else round(t_detect - t0, 3),
        "recovery_s": None if t_back is None else round(t_back - t0, 3),
        "takeover_s": round(t_takeover - t1, 3),
        "exit_codes": codes,
        "wall_s": round(time.time() - t_start, 1),
    }


def _wait(proc: Any, timeout: float) -> int | None:
    try:
        return int(proc.wait(timeout))
    except Exception:
        return None
