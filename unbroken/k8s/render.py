"""A job's Kubernetes objects from its :class:`~unbroken.k8s.k8s_settings.K8sSettings`: pure, no I/O.

One JobSet (``jobset.x-k8s.io/v1alpha2``) holds three replicated jobs:

* ``coordinator``: one child Job of two indexed pods, each ``unbroken coordinator --standby`` on
  the same state volume; the first to lock it serves, the other listens and takes over when the
  first dies or hangs (its lease lapses). A failed pod is replaced in its Job (``backoffLimit``)
  and comes back as the new standby;
* ``groups``: one child Job per replica group, its ``nodes_per_replica`` pods indexed, each
  ``unbroken agent`` with one slot;
* ``spares``: more such groups; their agents' slots are the coordinator's spares.

The job key never appears here: the pods mount the Secret ``settings.secret`` (create it with
``kubectl create secret generic NAME --from-file=secret=KEYFILE``). The failure rules, in order
(JobSet runs the first that matches a failed child Job):

1. ``deterministicExit``: a pod exited with one of :data:`DETERMINISTIC_EXITS` (its Job failed
   through its ``podFailurePolicy``, reason ``PodFailurePolicy``): FailJobSet, at once;
2. ``groupFailed``: with the RestartJob gate, a group's Job failed (any pod of it: backoffLimit
   0): RestartJob, that child Job alone is recreated. Without the gate the group's Job has a
   large backoffLimit: its failed pod is replaced alone and the Job does not fail (inside the
   pod the agent restarts the workers itself); should it fail anyway, RestartJobSet;
3. ``coordinatorFailed``: the coordinator's Job failed past its backoffLimit: FailJobSet.
"""

from __future__ import annotations

from typing import Any

from unbroken.k8s import commands
from unbroken.k8s.k8s_settings import COORDINATOR_JOB, GROUPS_JOB, SPARES_JOB, K8sSettings

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# The exit codes no restart can mend (docs/operations.md, "Exit codes"): 78 a configuration
# that can never work, 93 a crash loop, 94 the restart limit, 95 no progress.
DETERMINISTIC_EXITS = (78, 93, 94, 95)
PROG = ("unbroken",)
VOLUME_DIR = "/unbroken"  # the state claim: the coordinator's state and the agents' run directory
STATE_DIR = f"{VOLUME_DIR}/state"
RUN_DIR = f"{VOLUME_DIR}/run"
KEY_DIR = "/etc/unbroken"
KEY_FILE = f"{KEY_DIR}/secret"
KEY_MODE = 0o400  # JobSecret.load refuses a key others can read
AGENT_CONTAINER = "agent"
COORDINATOR_CONTAINER = "coordinator"
# Labels JobSet puts on its pods.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
RULE_DETERMINISTIC = "deterministicExit"
RULE_GROUP = "groupFailed"
RULE_COORDINATOR = "coordinatorFailed"


def render(s: K8sSettings) -> list[dict[str, Any]]:
    """Every object to apply, in the order to apply them."""
    objects = [claim(s)] if s.emit_state_claim else []
    return [*objects, coordinator_service(s), dashboard_service(s), jobset(s)]


def _meta(s: K8sSettings, name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels(s)}
    if s.namespace is not None:
        meta["namespace"] = s.namespace
    return {**meta, **extra}


def labels(s: K8sSettings) -> dict[str, str]:
    return {"app.kubernetes.io/name": "unbroken", "app.kubernetes.io/instance": s.name}


def claim(s: K8sSettings) -> dict[str, Any]:
    """The state volume: ReadWriteMany, its locks working across hosts (NFSv4, CephFS, Lustre)."""
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": s.state_claim_size}},
    }
    if s.storage_class is not None:
        spec["storageClassName"] = s.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(s, s.claim), "spec": spec}


def _coordinator_selector(s: K8sSettings) -> dict[str, str]:
    return {JOBSET_NAME_LABEL: s.name, REPLICATED_JOB_LABEL: COORDINATOR_JOB}


def coordinator_service(s: K8sSettings) -> dict[str, Any]:
    """The serving coordinator's control port (``unbroken status``): only the pod whose dashboard
    port listens is ready, and a standby opens it only once it took over."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(s, f"{s.name}-coordinator"),
        "spec": {
            "selector": _coordinator_selector(s),
            "ports": [{"name": "control", "port": s.port, "targetPort": s.port, "protocol": "TCP"}],
        },
    }


def dashboard_service(s: K8sSettings) -> dict[str, Any]:
    """The dashboard and ``/metrics`` (Prometheus: the job's read-only token as bearer)."""
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(s.http_port),
        "prometheus.io/path": "/metrics",
        "prometheus.io/scheme": "http",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(s, f"{s.name}-dashboard", annotations=annotations),
        "spec": {
            "selector": _coordinator_selector(s),
            "ports": [{"name": "http", "port": s.http_port, "targetPort": s.http_port, "protocol": "TCP"}],
        },
    }


def jobset(s: K8sSettings) -> dict[str, Any]:
    replicated = [
        {"name": COORDINATOR_JOB, "replicas": 1, "template": coordinator_job(s)},
        {"name": GROUPS_JOB, "replicas": s.replicas, "template": group_job(s)},
    ]
    if s.spare_groups:
        replicated.append({"name": SPARES_JOB, "replicas": s.spare_groups, "template": group_job(s)})
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": _meta(s, s.name),
        "spec": {
            # Pods reach each other as <pod hostname>.<name>, ready or not (a standby never is).
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": s.name},
            # Done when every replica group finished; the coordinator and spares are then deleted.
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [GROUPS_JOB]},
            "failurePolicy": failure_policy(s),
            "replicatedJobs": replicated,
        },
    }


def group_jobs(s: K8sSettings) -> list[str]:
    return [GROUPS_JOB, SPARES_JOB] if s.spare_groups else [GROUPS_JOB]


def failure_policy(s: K8sSettings) -> dict[str, Any]:
    rules: list[dict[str, Any]] = [
        {"name": RULE_DETERMINISTIC, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {
            "name": RULE_GROUP,
            "action": "RestartJob" if s.restart_job_gate else "RestartJobSet",
            "targetReplicatedJobs": group_jobs(s),
        },
        {"name": RULE_COORDINATOR, "action": "FailJobSet", "targetReplicatedJobs": [COORDINATOR_JOB]},
    ]
    return {"maxRestarts": s.max_restarts, "restartStrategy": "Recreate", "rules": rules}


def _pod_failure_policy(container: str, exits: tuple[int, ...]) -> dict[str, Any]:
    """A deterministic exit fails the Job at once (reason PodFailurePolicy); an eviction, a
    preemption or a drained node (DisruptionTarget) is not counted against its backoffLimit."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": list(exits)},
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _volumes(s: K8sSettings) -> list[dict[str, Any]]:
    return [
        {
            "name": "key",
            "secret": {"secretName": s.secret, "defaultMode": KEY_MODE, "items": [{"key": "secret", "path": "secret"}]},
        },
        {"name": "state", "persistentVolumeClaim": {"claimName": s.claim}},
    ]


def _mounts() -> list[dict[str, Any]]:
    return [{"name": "key", "mountPath": KEY_DIR, "readOnly": True}, {"name": "state", "mountPath": VOLUME_DIR}]


def _pod(s: K8sSettings, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"labels": labels(s)},
        "spec": {
            "restartPolicy": "Never",  # a podFailurePolicy needs it; the agent restarts workers itself
            "terminationGracePeriodSeconds": s.termination_grace_s,
            "containers": [container],
            "volumes": _volumes(s),
        },
    }


def coordinator_args(s: K8sSettings) -> list[str]:
    return commands.coordinator_argv(
        PROG,
        commands.CoordinatorArgs(
            host="0.0.0.0",
            port=s.port,
            replicas=s.replicas,
            min_replicas=s.quorum_min,
            state_dir=STATE_DIR,
            startup_window_s=s.startup_window_s,
            heartbeat_timeout_s=s.heartbeat_timeout_s,
            no_progress_timeout_s=s.no_progress_timeout_s,
            secret_file=KEY_FILE,
            http_port=s.http_port,
            hot_spares=s.hot_spares,
            standby=True,  # both pods: the first to lock the state directory serves
        ),
    )


def coordinator_job(s: K8sSettings) -> dict[str, Any]:
    container = {
        "name": COORDINATOR_CONTAINER,
        "image": s.image,
        "command": coordinator_args(s),
        "ports": [
            {"name": "control", "containerPort": s.port, "protocol": "TCP"},
            {"name": "http", "containerPort": s.http_port, "protocol": "TCP"},
        ],
        # Ready = serving: the dashboard's port opens only after a takeover.
        "readinessProbe": {"tcpSocket": {"port": s.http_port}, "periodSeconds": 2},
        "volumeMounts": _mounts(),
    }
    return {
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": s.coordinator_backoff_limit,
            "podFailurePolicy": _pod_failure_policy(COORDINATOR_CONTAINER, DETERMINISTIC_EXITS),
            "template": _pod(s, container),
        }
    }


NODE_VAR, ADDR_VAR = "POD_NAME", "POD_IP"


def agent_args(s: K8sSettings) -> list[str]:
    """The agent's command; ``$(POD_NAME)`` and ``$(POD_IP)`` are expanded by the kubelet."""
    return commands.agent_argv(
        PROG,
        commands.AgentArgs(
            coordinators=s.coordinator_addresses(),
            node=f"$({NODE_VAR})",  # unique per pod, also across a recreated Job
            run_dir=RUN_DIR,
            secret_file=KEY_FILE,
            ranks_per_replica=s.ranks_per_replica,
            nodes_per_replica=s.nodes_per_replica,
            slots=1,
            advertise_addr=f"$({ADDR_VAR})",
            connect_timeout_s=s.connect_timeout_s,
            term_grace_s=s.term_grace_s,
        ),
        s.command,
    )


def agent_env(s: K8sSettings) -> list[dict[str, Any]]:
    """The pod's identity, and torchrun's launcher variables (``PET_*``) for tools that read them.
    Each worker's RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK and MASTER_ADDR/PORT are set by the
    agent from the coordinator's placement, as torchrun sets them: never at the pod's level."""
    return [
        {"name": NODE_VAR, **_field("metadata.name")},
        {"name": ADDR_VAR, **_field("status.podIP")},
        {"name": "PET_NNODES", "value": str(s.nodes_per_replica)},
        {"name": "PET_NPROC_PER_NODE", "value": str(s.ranks_per_node)},
        {"name": "PET_NODE_RANK", **_field(f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']")},
        {"name": "JOBSET_JOB_INDEX", **_field(f"metadata.labels['{JOB_INDEX_LABEL}']")},
    ]


def group_job(s: K8sSettings) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": s.image,
        "command": agent_args(s),
        "env": agent_env(s),
        "volumeMounts": _mounts(),
    }
    if s.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": s.gpus_per_node}}
    return {
        "spec": {
            "completionMode": "Indexed",
            "completions": s.nodes_per_replica,
            "parallelism": s.nodes_per_replica,
            # With the gate, any pod failing fails the group's Job, which RestartJob recreates
            # alone; without it, a failed pod is replaced alone and the Job goes on.
            "backoffLimit": 0 if s.restart_job_gate else s.pod_backoff_limit,
            "podFailurePolicy": _pod_failure_policy(AGENT_CONTAINER, DETERMINISTIC_EXITS),
            "template": _pod(s, container),
        }
    }
