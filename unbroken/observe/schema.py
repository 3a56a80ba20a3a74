"""The schema of ``events.jsonl``: one frozen dataclass per event kind, and nothing else.

Every component that writes an event (the coordinator, the diagnosis service, the supervisor of
``unbroken run``, a node agent) builds one of these, and every reader (``unbroken status``, the
metrics and dashboard of :mod:`unbroken.observe.http`, the goodput accounting) gets them back
with :func:`parse`. The module sits in ``observe``, below every layer that emits
(``control``, ``diagnosis``, ``launch``), and imports nothing of the project's.

Why dataclasses and not msgspec or pydantic: the events are few per second, so validation speed
does not matter; the standard library keeps the core's dependencies as they are; and a frozen
dataclass with ``kw_only`` gives a reader named, typed fields and a writer a ``TypeError`` at the
call site for a field that does not exist or is missing.

On disk an event stays one JSON object per line, its fields at the top level as before (so
``jq`` and old readers keep working), with ``schema`` (:data:`SCHEMA_VERSION`), ``t``,
``source`` and ``kind`` first. A line without ``schema`` is version 0, the untyped log of
earlier releases, whose field names are the same: it parses too. The field ``class`` of a
verdict is ``verdict_class`` in Python (``class`` is a keyword).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

SCHEMA_VERSION = 1

# JSON names that are not Python identifiers (or would shadow one), and their field names.
_RENAMED = {"class": "verdict_class"}
_RENAMED_BACK = {v: k for k, v in _RENAMED.items()}


class EvictCause(str, enum.Enum):
    """Why the coordinator evicted a replica. The supervisor acts on the cause (a hang is
    restarted, an exit was seen already), never on the wording of ``reason``."""

    CONNECTION_CLOSED = "connection_closed"  # its process died or lost its network
    PROCESS_EXITED = "process_exited"  # its supervisor or agent saw the process exit
    NO_HEARTBEAT = "no_heartbeat"  # silent past the heartbeat timeout: hung or stopped
    STEP_WENT_BACK = "step_went_back"  # asked for a step below the one its epoch trains
    AGENT_LOST = "agent_lost"  # the node agent that ran it is gone
    UNKNOWN = "unknown"  # a version-0 log, which kept only the prose


class FailureCause(str, enum.Enum):
    """What failed a replica, as the supervisor decides its restart (restarts are counted by it)."""

    PROCESS_EXIT = "process_exit"  # a process of it exited (a crash, an OOM kill)
    HANG = "hang"  # evicted for silence while its processes ran
    VERDICT = "verdict"  # a diagnosis verdict named it
    ROLLBACK = "rollback"  # restarted with every replica onto an older checkpoint
    UNKNOWN = "unknown"


class AgentLostCause(str, enum.Enum):
    CONNECTION_CLOSED = "connection_closed"
    NO_HEARTBEAT = "no_heartbeat"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has: when (wall clock), who wrote it, and its kind (the class)."""

    KIND: ClassVar[str] = ""
    t: float = dataclasses.field(default_factory=time.time)
    source: str = ""

    @property
    def kind(self) -> str:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        """The JSON line's object: ``schema``, ``t``, ``source``, ``kind``, then the fields."""
        out: dict[str, Any] = {"schema": SCHEMA_VERSION, "t": self.t, "source": self.source, "kind": self.KIND}
        for name, key, optional in _layout(type(self)):
            value = getattr(self, name)
            if value is None and optional:
                continue  # an optional field left out is absent, as in the untyped log ("rank" in e)
            out[key] = value.value if isinstance(value, enum.Enum) else value
        return out


_LAYOUTS: dict[type, tuple[tuple[str, str, bool], ...]] = {}  # one entry per event class: bounded by the schema


def _layout(cls: type[Event]) -> tuple[tuple[str, str, bool], ...]:
    """An event class's fields as (attribute, JSON key, left out when None), ``t`` and ``source``
    aside: made once per class, not per event (a takeover at 12,500 nodes writes 12,500
    ``replica_connected`` events in the standby's one loop; 3 of a node hello's 91 us)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = tuple(
            (f.name, _RENAMED_BACK.get(f.name, f.name), f.default is None)
            for f in dataclasses.fields(cls)
            if f.name not in ("t", "source")
        )
    return layout


E = TypeVar("E", bound=Event)
KINDS: dict[str, type[Event]] = {}


def _kind(name: str) -> Callable[[type[E]], type[E]]:
    """Registers an event class under its JSON ``kind``."""

    def register(cls: type[E]) -> type[E]:
        if name in KINDS:
            raise RuntimeError(f"event kind {name!r} defined twice")
        cls.KIND = name
        KINDS[name] = cls
        return cls

    return register


# -- the coordinator -----------------------------------------------------------------------


@_kind("coordinator_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorStarted(Event):
    address: str
    store: str = ""


@_kind("coordinator_restarted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorRestarted(Event):
    """Written by the coordinator that found history in its state directory
    (``continue_after_epoch``), and by the supervisor that restarted it after a
    ``coordinator_kill`` fault (``address`` and the fault's fields)."""

    continue_after_epoch: int | None = None
    address: str | None = None
    fault: int | None = None
    fault_kind: str | None = None
    target: str | None = None
    label: str | None = None
    replica: int | None = None
    rank: int | None = None
    link: list[int] | None = None
    step: int | None = None


@_kind("epoch_resumed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class EpochResumed(Event):
    """A coordinator that found history continues its last epoch (:mod:`unbroken.control.quorum.resume`):
    members saying it in their hello are answered in it; those not back within ``window_s`` are
    evicted."""

    epoch: int
    step: int
    members: list[int]
    window_s: float


@_kind("resume_given_up")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeGivenUp(Event):
    """The resumed epoch is given up: member ``replica`` trains in another epoch (``said``; None:
    none, a restarted process), so the history was behind or the group is gone; the next epoch
    forms as a first one."""

    epoch: int
    replica: int
    said: int | None = None


@_kind("replica_connected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaConnected(Event):
    replica: int
    node: str = ""
    step: int = 0


@_kind("replica_evicted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaEvicted(Event):
    replica: int
    cause: EvictCause = EvictCause.UNKNOWN
    reason: str = ""
    member: bool = False


@_kind("replica_silent")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaSilent(Event):
    replicas: list[int]
    after_s: float


@_kind("replica_finished")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaFinished(Event):
    replica: int
    rank: int | None = None


@_kind("replica_reassigned")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaReassigned(Event):
    replica: int
    from_node: str
    to_node: str


@_kind("quorum")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Quorum(Event):
    epoch: int
    step: int
    members: list[int]
    behind: list[int] = dataclasses.field(default_factory=list)
    donors: list[list[int]] = dataclasses.field(default_factory=list)


@_kind("exchange_failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeFailed(Event):
    replica: int
    epoch: int
    step: int


@_kind("donor_told")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DonorTold(Event):
    newcomer: int
    donor: int
    epoch: int


@_kind("agent_joined")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentJoined(Event):
    node: str
    slots: int
    replicas: list[int]
    addr: str | None = None  # the address a multi-node replica group's other nodes dial


@_kind("group_moved")
@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupMoved(Event):
    """A replica group spanning nodes lost ``lost_node`` and now runs on ``nodes``."""

    replica: int
    lost_node: str
    nodes: list[str]


@_kind("group_failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupFailed(Event):
    """A replica group spanning nodes left the quorum as one; ``blamed`` is the node at fault."""

    replica: int
    blamed: str | None = None
    reason: str = ""


@_kind("agent_lost")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentLost(Event):
    node: str
    replicas: list[int]
    cause: AgentLostCause = AgentLostCause.UNKNOWN
    reason: str = ""


@_kind("stack")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Stack(Event):
    """A hung rank's stack, from its owner (the supervisor here, or a node agent)."""

    replica: int
    rank: int
    node: str | None = None
    process_state: str | None = None
    stack: str | None = None
    stack_note: str | None = None


@_kind("job_finished")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFinished(Event):
    """The coordinator's (``finished``: the replicas that did), the supervisor's (``ok``), or
    an agent's (told by the coordinator: neither)."""

    ok: bool | None = None
    finished: list[int] | None = None


@_kind("verdict")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict(Event):
    """A diagnosis verdict (:mod:`unbroken.diagnosis.verdict`); ``class`` on disk."""

    culprit: dict[str, Any]
    verdict_class: str
    confidence: float
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    detect_s: float | None = None


# -- the supervisor (unbroken run) and node agents -------------------------------------------


@_kind("job_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobStarted(Event):
    replicas: int
    spares: int
    schedule: list[dict[str, Any]]
    coordinator: str


@_kind("replica_state")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaState(Event):
    """A lifecycle transition (:mod:`unbroken.launch.lifecycle`)."""

    replica: int
    old: str
    new: str
    reason: str


@_kind("process_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessStarted(Event):
    replica: int
    rank: int
    pid: int
    restart: int
    node: str
    slot: str | None = None
    resume_step: int | None = None
    local_rank: int | None = None  # on a node running part of a replica group: the rank there


@_kind("process_exited")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessExited(Event):
    replica: int
    rank: int
    pid: int
    exitcode: int | None
    action: str
    reason: str | None = None
    decision_ms: float | None = None


@_kind("restart_decision")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartDecision(Event):
    replica: int
    action: str
    delay_s: float
    reason: str
    cause: str  # the failure in words
    decision_ms: float
    failure: FailureCause = FailureCause.UNKNOWN


@_kind("node_isolated")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeIsolated(Event):
    node: str
    reason: str
    replica: int | None = None


@_kind("job_failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFailed(Event):
    """The job was ended: by the supervisor's restart policy (a crash loop, the restart limit), or
    by the coordinator (``cause``: ``configuration``, an error no retry can mend at every member
    of epochs in a row, with the ``error``, the ``members`` and a ``hint``; ``no_progress``)."""

    reason: str
    exit_code: int
    cause: str = ""
    error: str = ""
    members: list[int] = dataclasses.field(default_factory=list)
    hint: str = ""


@_kind("replica_given_up")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaGivenUp(Event):
    replica: int
    reason: str
    restarts: int | None = None


@_kind("replica_restarting")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaRestarting(Event):
    replica: int
    restart: int
    delay_s: float | None = None  # a node agent's backoff before the restart


@_kind("replica_stopped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaStopped(Event):
    replica: int
    reason: str


@_kind("verdict_ignored")
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerdictIgnored(Event):
    verdict_class: str | None
    replica: int | None
    action: str
    reason: str


@_kind("verdict_acted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerdictActed(Event):
    verdict_class: str | None
    replica: int | None
    action: str
    reason: str


@_kind("rollback")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollback(Event):
    step: int
    anomaly_step: int
    culprit: int | None
    anomaly: Any = None
    skipped: list[Any] = dataclasses.field(default_factory=list)


@_kind("checkpoints_kept")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointsKept(Event):
    rollback_step: int
    reason: str


@_kind("checkpoints_discarded")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointsDiscarded(Event):
    steps: list[int]
    rollback_step: int


@_kind("checkpoint_saved")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSaved(Event):
    """A rank's snapshot: how long the training loop was blocked, how many tensor bytes."""

    replica: int
    rank: int
    step: int
    stall_s: float
    nbytes: int


@_kind("checkpoint_persisted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPersisted(Event):
    """A rank's snapshot written to disk (``ok``) or not, ``persist_s`` after its write began."""

    replica: int
    rank: int
    step: int
    ok: bool
    persist_s: float
    nbytes: int


@_kind("caught_up")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CaughtUp(Event):
    """A rank that caught up from a peer: the state's bytes, and seconds from fetch to loaded."""

    replica: int
    rank: int
    step: int
    seconds: float
    nbytes: int


@_kind("sdc_detected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SdcDetected(Event):
    """A rank's exchange check found members' fingerprints differing (:mod:`unbroken.train.step.sdc_check`):
    ``what`` differed (``results``, ``weights``, or ``rerun``: a re-run named the first results'
    culprit) at ``step`` of ``epoch``; ``culprits`` named; whether this rank ``committed`` the step."""

    replica: int
    rank: int
    step: int
    epoch: int
    what: str
    culprits: list[int]
    committed: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FaultFields(Event):
    """A scheduled fault (:mod:`unbroken.faults.schedule`) and the job step it fired at."""

    fault: int
    fault_kind: str
    target: str | None = None
    label: str | None = None
    replica: int | None = None
    rank: int | None = None
    link: list[int] | None = None
    step: int | None = None


@_kind("fault_injected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultInjected(_FaultFields):
    pid: int | None = None
    writers: list[int] | None = None
    applied_by: str | None = None  # "worker": the worker applies it itself (slow rank, link)


@_kind("fault_skipped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSkipped(_FaultFields):
    reason: str = ""


@_kind("fault_cleared")
@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultCleared(_FaultFields):
    pid: int | None = None


@_kind("self_check")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SelfCheck(Event):
    node: str
    passed: bool


@_kind("node_readmitted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeReadmitted(Event):
    node: str


@_kind("job_interrupted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobInterrupted(Event):
    pass


@_kind("sigterm_received")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SigtermReceived(Event):
    grace_s: float


@_kind("job_terminated")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobTerminated(Event):
    grace_s: float
    exit_codes: dict[Any, list[int | None]]
    killed: int
    drain_s: float


@_kind("agent_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentStarted(Event):
    node: str
    slots: int
    coordinator: str
    relay: str | None = None  # the loopback address its ranks reach the coordinator through
    store: str | None = None  # the rendezvous store it hosts for the cross-replica groups led from it


@_kind("relay_failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayFailed(Event):
    """The agent's relay stopped (its own code failed): its ranks moved to the coordinator directly."""

    reason: str


@_kind("agent_interrupted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentInterrupted(Event):
    pass


@_kind("agent_terminated")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentTerminated(Event):
    grace_s: float
    killed: int
    exit_codes: dict[Any, list[int | None]]
    drain_s: float | None = None


@_kind("agent_stopped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentStopped(Event):
    exit_code: int | None
    store_requests: int | None = None  # requests its rendezvous store answered (None: it hosted none)


@_kind("coordinator_lost")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorLost(Event):
    pass


@_kind("coordinator_disconnected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorDisconnected(Event):
    pass


@_kind("coordinator_silent")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorSilent(Event):
    """A coordinator with a standby answered no heartbeat for ``seconds``: taken for hung."""

    seconds: float


@_kind("coordinator_stale")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorStale(Event):
    """A coordinator assigned this agent under lease ``term``, older than ``newest`` it was assigned
    by before: a replaced coordinator still listening. The agent left it for the next address."""

    term: int
    newest: int


@_kind("coordinator_reconnected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorReconnected(Event):
    running: list[int] | None
    assigned: list[int]


@_kind("replicas_assigned")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicasAssigned(Event):
    replicas: list[int]
    group_rank: int | None = None  # for a replica group spanning nodes: this node's place in it
    incarnation: int | None = None
    master: str | None = None  # the group's rendezvous address


@_kind("group_stopped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupStopped(Event):
    """A node agent ended its ranks of a replica group the coordinator took out as one."""

    replica: int
    incarnation: int


@_kind("group_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupStarted(Event):
    """A replica group spanning ``nodes`` is (re)started, its ``incarnation``-th start."""

    replica: int
    incarnation: int
    nodes: list[str]


@_kind("replica_set_aside")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaSetAside(Event):
    """A replica whose epochs keep failing (it reaches the coordinator, not its peers) is held out
    of the quorum for ``hold_s`` so that the others train on (:mod:`unbroken.control.quorum.setaside`)."""

    replica: int
    failed_epochs: list[int]
    hold_s: float
    reason: str = ""


# -- building and reading ------------------------------------------------------------------


def build(kind: str, **fields: Any) -> Event:
    """The event of ``kind`` with ``fields`` (JSON names: ``class`` for a verdict's class).

    Raises:
        KeyError: no such kind (add its class here first).
        TypeError: a field the kind does not have, or one it needs that is missing.
    """
    cls = KINDS.get(kind)
    if cls is None:
        raise KeyError(f"no event kind {kind!r} in unbroken.observe.schema")
    return cls(**{_RENAMED.get(k, k): v for k, v in fields.items()})


def parse(record: Mapping[str, Any]) -> Event | None:
    """The typed event of one JSON line's object; None for a kind this version does not know
    or a line that does not fit its kind (a newer writer, a damaged file): a reader skips it.

    Fields this version does not know are dropped; a cause a newer writer added, or the
    missing cause of a version-0 line (which kept only prose), reads as ``unknown``.
    """
    cls = KINDS.get(str(record.get("kind")))
    if cls is None or not isinstance(record.get("t"), (int, float)):
        return None
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in record.items():
        name = _RENAMED.get(key, key)
        if name in names and key != "kind":
            kwargs[name] = value
    for name in names:
        enum_type = _ENUM_FIELDS.get((cls, name))
        if enum_type is not None and name in kwargs and not isinstance(kwargs[name], enum_type):
            try:
                kwargs[name] = enum_type(kwargs[name])
            except ValueError:
                kwargs[name] = enum_type("unknown")
    try:
        return cls(**kwargs)
    except TypeError:
        return None


_ENUM_FIELDS: dict[tuple[type[Event], str], type[enum.Enum]] = {
    (ReplicaEvicted, "cause"): EvictCause,
    (AgentLost, "cause"): AgentLostCause,
    (RestartDecision, "failure"): FailureCause,
}
