"""What a Kubernetes deployment of a job is made from: one typed, checked record.

Every check says what to fix. The names follow JobSet's own limits (its webhook's): the JobSet's
name, its replicated jobs' names and indexes make every child Job's and pod's name, and those
must be DNS-1035 labels of at most 63 characters.
"""

from __future__ import annotations

import dataclasses
import re

# JobSet's RestartJob action: the webhook refuses a replicatedJob of more replicas than this
# (the status keeps one restart counter per child Job, in a list of at most 1,024).
MAX_RESTART_JOB_REPLICAS = 1024
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
POD_SUFFIX = "-abcde"  # the random suffix a Job's pod name ends in

# The replicated jobs of the JobSet, by role.
COORDINATOR_JOB = "coordinator"
GROUPS_JOB = "groups"
SPARES_JOB = "spares"


def pod_hostname(jobset: str, replicated_job: str, job_index: int, pod_index: int) -> str:
    """The hostname JobSet gives a pod (``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``)."""
    return f"{jobset}-{replicated_job}-{job_index}-{pod_index}"


@dataclasses.dataclass(frozen=True)
class K8sSettings:
    """A job on Kubernetes: replica groups as child Jobs of one JobSet, a coordinator and its standby.

    ``replicas`` groups of ``nodes_per_replica`` pods each run ``unbroken agent`` (one slot each),
    ``spares`` more such groups wait as spares (agents with a free slot), ``hot_spares`` more run
    replicas that wait, model built, for a lost one's place (``unbroken coordinator
    --hot-spares``; their pods are in the spares' Job too); the coordinator Job holds two pods, each running
    ``unbroken coordinator --standby`` on one state volume: the first to lock it serves, the
    other takes over when it goes.
    """

    image: str
    command: tuple[str, ...]
    name: str = "unbroken"
    namespace: str | None = None
    replicas: int = 2
    min_replicas: int | None = None  # None: a majority
    spares: int = 0
    hot_spares: int = 0
    nodes_per_replica: int = 1
    ranks_per_replica: int = 1
    gpus_per_node: int = 0
    port: int = 29510
    http_port: int = 9400
    heartbeat_timeout_s: float = 2.0
    startup_window_s: float = 20.0
    no_progress_timeout_s: float = 900.0
    # JobSet's RestartJob feature gate is on in the cluster: a group's failed child Job is
    # recreated alone. Off: a group's Job never fails (its pods are replaced one by one).
    restart_job_gate: bool = False
    max_restarts: int = 100  # JobSet's failurePolicy.maxRestarts
    pod_backoff_limit: int = 10_000  # a group Job's backoffLimit without the gate
    coordinator_backoff_limit: int = 1_000
    secret_name: str | None = None  # default: <name>-key
    state_claim: str | None = None  # default: <name>-state
    state_claim_size: str = "10Gi"
    storage_class: str | None = None
    emit_state_claim: bool = True
    term_grace_s: float = 25.0
    termination_grace_s: int = 30
    connect_timeout_s: float = 300.0

    @property
    def spare_groups(self) -> int:
        """Child Jobs of the spares' replicated job: the spares and the hot spares."""
        return self.spares + self.hot_spares

    def __post_init__(self) -> None:
        errors = problems(self)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def secret(self) -> str:
        return self.secret_name or f"{self.name}-key"

    @property
    def claim(self) -> str:
        return self.state_claim or f"{self.name}-state"

    @property
    def quorum_min(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas // 2 + 1

    @property
    def ranks_per_node(self) -> int:
        return self.ranks_per_replica // self.nodes_per_replica

    def coordinator_addresses(self) -> tuple[str, ...]:
        """The two coordinator pods by their stable DNS names (JobSet's headless Service)."""
        return tuple(f"{pod_hostname(self.name, COORDINATOR_JOB, 0, i)}.{self.name}:{self.port}" for i in range(2))


def problems(s: K8sSettings) -> list[str]:
    """Everything wrong with ``s``, each saying what to fix (empty: it renders)."""
    out = []
    if not _DNS1035.match(s.name):
        out.append(
            f"--name {s.name!r} must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter"
        )
    if s.namespace is not None and not (_DNS1123.match(s.namespace) and len(s.namespace) <= MAX_NAME):
        out.append(f"--namespace {s.namespace!r} must be a DNS-1123 label of at most {MAX_NAME} characters")
    if not s.image.strip():
        out.append("--image is empty: give the container image that holds unbroken and your training script")
    if not s.command:
        out.append("no training command: give it after `--` (e.g. -- python train.py)")
    if s.replicas < 1:
        out.append(f"--replicas must be at least 1, got {s.replicas}")
    if s.min_replicas is not None and not 1 <= s.min_replicas <= s.replicas:
        out.append(f"--min-replicas must be in [1, --replicas={s.replicas}], got {s.min_replicas}")
    if s.spares < 0:
        out.append(f"--spares must be 0 or more, got {s.spares}")
    if s.hot_spares < 0:
        out.append(f"--hot-spares must be 0 or more, got {s.hot_spares}")
    if s.nodes_per_replica < 1:
        out.append(f"--nodes-per-replica must be at least 1, got {s.nodes_per_replica}")
    elif s.ranks_per_replica < 1 or s.ranks_per_replica % s.nodes_per_replica:
        out.append(
            f"--ranks-per-replica ({s.ranks_per_replica}) must be a positive multiple of "
            f"--nodes-per-replica ({s.nodes_per_replica}): every node runs the same number of ranks"
        )
    if s.gpus_per_node < 0:
        out.append(f"--gpus-per-node must be 0 or more, got {s.gpus_per_node}")
    for flag, port in (("--port", s.port), ("--http-port", s.http_port)):
        if not 1 <= port <= 65535:
            out.append(f"{flag} must be a TCP port in [1, 65535], got {port}")
    if s.port == s.http_port:
        out.append(f"--port and --http-port must differ (both {s.port})")
    if s.restart_job_gate and max(s.replicas, s.spare_groups) > MAX_RESTART_JOB_REPLICAS:
        out.append(
            f"JobSet's RestartJob allows at most {MAX_RESTART_JOB_REPLICAS} child Jobs per replicated job, "
            f"got {max(s.replicas, s.spare_groups)}: use fewer, larger groups (--nodes-per-replica) "
            "or drop --restart-job-gate"
        )
    if s.max_restarts < 0 or s.pod_backoff_limit < 0 or s.coordinator_backoff_limit < 0:
        out.append("--max-restarts and the backoff limits must be 0 or more")
    if s.term_grace_s >= s.termination_grace_s:
        out.append(
            f"--term-grace-s ({s.term_grace_s:g}) must be below the pods' terminationGracePeriodSeconds "
            f"({s.termination_grace_s}): the kubelet kills the pod before the workers flush"
        )
    for what, value in (("--secret-name", s.secret_name), ("--state-claim", s.state_claim)):
        if value is not None and not (_DNS1123.match(value) and len(value) <= MAX_NAME):
            out.append(f"{what} {value!r} must be a DNS-1123 label of at most {MAX_NAME} characters")
    out += _name_lengths(s)
    return out


def _name_lengths(s: K8sSettings) -> list[str]:
    """JobSet's webhook: every child Job's and pod's name (the longest index) fits 63 characters."""
    out = []
    shapes = [(COORDINATOR_JOB, 1, 2), (GROUPS_JOB, s.replicas, s.nodes_per_replica)]
    if s.spare_groups:
        shapes.append((SPARES_JOB, s.spare_groups, s.nodes_per_replica))
    for rjob, jobs, pods in shapes:
        longest = pod_hostname(s.name, rjob, jobs - 1, pods - 1) + POD_SUFFIX
        if len(longest) > MAX_NAME:
            out.append(
                f"--name {s.name!r} is too long: pod names such as {longest!r} would exceed {MAX_NAME} characters; "
                f"shorten it to at most {len(s.name) - (len(longest) - MAX_NAME)} characters"
            )
            break
    for what in (f"{s.name}-coordinator", f"{s.name}-dashboard"):
        if len(what) > MAX_NAME:
            out.append(f"--name {s.name!r} is too long for the Service name {what!r} ({MAX_NAME} characters at most)")
    return out
