"""A rank's telemetry, typed: what its flight recorder ships and the diagnosis master reads.

Besides collectives and transfers, a batch carries what the rank's checkpoints and catch-ups
cost (:class:`CheckpointSaved`, :class:`CheckpointPersisted`, :class:`CaughtUp`) and the silent
data corruption its exchange check found (:class:`SdcFound`): the coordinator writes them to
the event log, where ``/metrics`` finds them.

A batch rides with the heartbeat about ten times a second and holds up to a few hundred
records, so on the wire each record is a row, a JSON array in its dataclass's field order (field
names would triple the bytes); ``to_row``/``from_row`` are the only code that knows the order.
The batch comes from the network, so :meth:`TelemetryBatch.from_msg` checks every field (type,
length, range) and rejects a malformed batch whole with :class:`TelemetryError`: the master never
sees one. The records are mutable (``slots``) because the recorder fills a collective's exit in
place on the training thread, where a new object per step would cost more than the record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MAX_ROWS = 1024  # per list in one batch; the recorder ships at most its batch_max (256)
MAX_COSTS = 64  # checkpoint and catch-up records per batch (the recorder keeps at most 64); each becomes an event
MAX_MEMBERS = 100_000
MAX_TEXT = 256
MAX_NS = 1 << 63
MAX_SECONDS = 86400.0
DIRECTIONS = ("send", "recv")


class TelemetryError(ValueError):
    """A telemetry batch that does not match this schema (a bug or a forgery): it is skipped."""


@dataclasses.dataclass(slots=True)
class Collective:
    """One collective on one rank, from entry to exit (``exit_ns`` 0 while it is open).

    ``ok``: True done; False abandoned at its own deadline (a stall); None failed for a known
    reason (the coordinator's abort, a closed connection). ``rq_*_ns``: the training thread's
    cumulative run-queue wait at entry and exit (:class:`unbroken.comm.runqueue.RunQueueWait`),
    so the master can tell a busy machine from a slow rank. Times are the rank's monotonic clock.
    """

    group: str
    seq: int
    op: str
    nbytes: int
    enter_ns: int
    exit_ns: int
    ok: bool | None
    members: list[int]
    rq_enter_ns: int
    rq_exit_ns: int

    def to_row(self) -> list[Any]:
        return [
            self.group,
            self.seq,
            self.op,
            self.nbytes,
            self.enter_ns,
            self.exit_ns,
            self.ok,
            self.members,
            self.rq_enter_ns,
            self.rq_exit_ns,
        ]

    @classmethod
    def from_row(cls, row: Any) -> Collective:
        group, seq, op, nbytes, enter_ns, exit_ns, ok, members, rq_enter, rq_exit = _row(row, 10, "collective")
        if ok is not None and not isinstance(ok, bool):
            raise TelemetryError(f"a collective's ok must be true, false or null, got {ok!r:.40}")
        if not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise TelemetryError(f"a collective's members must be a list of at most {MAX_MEMBERS} replica ids")
        return cls(
            group=_text(group, "group"),
            seq=_int(seq, "seq"),
            op=_text(op, "op"),
            nbytes=_int(nbytes, "nbytes"),
            enter_ns=_int(enter_ns, "enter_ns"),
            exit_ns=_int(exit_ns, "exit_ns"),
            ok=ok,
            members=[_int(m, "member") for m in members],
            rq_enter_ns=_int(rq_enter, "rq_enter_ns"),
            rq_exit_ns=_int(rq_exit, "rq_exit_ns"),
        )


@dataclasses.dataclass(slots=True)
class Transfer:
    """One ring transfer to or from a peer replica (``done_ns`` 0 while it is open).

    ``rq_post_ns``/``rq_done_ns``: the ring thread's cumulative run-queue wait when the transfer
    was posted and when it finished; their difference is time the data may have waited for a
    CPU on this machine rather than on the wire (a busy host is not a slow link).
    """

    group: str
    seq: int
    direction: str  # "send" or "recv"
    peer: int  # a replica id
    ring_step: int
    nbytes: int
    post_ns: int
    done_ns: int
    rq_post_ns: int = 0
    rq_done_ns: int = 0

    def to_row(self) -> list[Any]:
        return [
            self.group,
            self.seq,
            self.direction,
            self.peer,
            self.ring_step,
            self.nbytes,
            self.post_ns,
            self.done_ns,
            self.rq_post_ns,
            self.rq_done_ns,
        ]

    @classmethod
    def from_row(cls, row: Any) -> Transfer:
        group, seq, direction, peer, ring_step, nbytes, post_ns, done_ns, rq_post, rq_done = _row(row, 10, "transfer")
        if direction not in DIRECTIONS:
            raise TelemetryError(f"a transfer's direction must be send or recv, got {direction!r:.40}")
        return cls(
            group=_text(group, "group"),
            seq=_int(seq, "seq"),
            direction=direction,
            peer=_int(peer, "peer"),
            ring_step=_int(ring_step, "ring_step"),
            nbytes=_int(nbytes, "nbytes"),
            post_ns=_int(post_ns, "post_ns"),
            done_ns=_int(done_ns, "done_ns"),
            rq_post_ns=_int(rq_post, "rq_post_ns"),
            rq_done_ns=_int(rq_done, "rq_done_ns"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Stall:
    """A failed collective's transfers that never finished: the evidence of a stuck link.

    ``deadline_passed``: this rank gave up at its own deadline (it was not aborted for another's).
    """

    group: str
    seq: int
    transfers: list[Transfer]
    deadline_passed: bool

    def to_row(self) -> list[Any]:
        return [self.group, self.seq, [t.to_row() for t in self.transfers], self.deadline_passed]

    @classmethod
    def from_row(cls, row: Any) -> Stall:
        group, seq, transfers, deadline = _row(row, 4, "stall")
        if not isinstance(deadline, bool):
            raise TelemetryError(f"a stall's deadline_passed must be a boolean, got {deadline!r:.40}")
        return cls(_text(group, "group"), _int(seq, "seq"), _rows(transfers, "stall transfers", Transfer), deadline)


@dataclasses.dataclass(frozen=True, slots=True)
class StepMetrics:
    """A step's training metrics: non-finite loss or norm are allowed (they are what is detected)."""

    step: int
    loss: float | None
    grad_norm: float | None
    memory: float | None  # bytes

    def to_row(self) -> list[Any]:
        return [self.step, self.loss, self.grad_norm, self.memory]

    @classmethod
    def from_row(cls, row: Any) -> StepMetrics:
        step, loss, grad_norm, memory = _row(row, 4, "step metrics")
        mem = _number(memory, "memory")
        if mem is not None and not (math.isfinite(mem) and mem >= 0):
            raise TelemetryError(f"memory must be a finite number of bytes >= 0, got {memory!r:.40}")
        return cls(_int(step, "step"), _number(loss, "loss"), _number(grad_norm, "grad_norm"), mem)


@dataclasses.dataclass(frozen=True, slots=True)
class FlaggedLink:
    """A connection whose ICCL window monitor sees congestion (data waiting, throughput low)."""

    direction: str
    peer: int

    def to_row(self) -> list[Any]:
        return [self.direction, self.peer]

    @classmethod
    def from_row(cls, row: Any) -> FlaggedLink:
        direction, peer = _row(row, 2, "flagged link")
        if direction not in DIRECTIONS:
            raise TelemetryError(f"a flagged link's direction must be send or recv, got {direction!r:.40}")
        return cls(direction, _int(peer, "peer"))


PATH_EVENTS = ("down", "up", "failover", "failback", "flagged")


@dataclasses.dataclass(frozen=True, slots=True)
class PathEvent:
    """Something that happened to one NIC port's connection of an ICCL hop (:mod:`unbroken.comm.iccl`):
    ``age_s`` before the batch was made (an age, not a time: the hosts' clocks need not agree),
    on ``host``'s ``interface`` towards ring rank ``peer``."""

    age_s: float
    host: str
    interface: str
    peer: int
    what: str
    why: str

    def to_row(self) -> list[Any]:
        return [self.age_s, self.host, self.interface, self.peer, self.what, self.why]

    @classmethod
    def from_row(cls, row: Any) -> PathEvent:
        age, host, interface, peer, what, why = _row(row, 6, "path event")
        if what not in PATH_EVENTS:
            raise TelemetryError(f"a path event must be one of {', '.join(PATH_EVENTS)}, got {what!r:.40}")
        return cls(
            _seconds(age, "age_s"),
            _text(host, "host"),
            _text(interface, "interface"),
            _int(peer, "peer"),
            what,
            _text(why, "why"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """A checkpoint snapshot taken: ``stall_s`` the training loop was blocked, ``nbytes`` copied."""

    step: int
    stall_s: float
    nbytes: int

    def to_row(self) -> list[Any]:
        return [self.step, self.stall_s, self.nbytes]

    @classmethod
    def from_row(cls, row: Any) -> CheckpointSaved:
        step, stall_s, nbytes = _row(row, 3, "checkpoint saved")
        return cls(_int(step, "step"), _seconds(stall_s, "stall_s"), _int(nbytes, "nbytes"))


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointPersisted:
    """A snapshot written to disk (``ok``) or not, ``persist_s`` after the write began."""

    step: int
    ok: bool
    persist_s: float
    nbytes: int

    def to_row(self) -> list[Any]:
        return [self.step, self.ok, self.persist_s, self.nbytes]

    @classmethod
    def from_row(cls, row: Any) -> CheckpointPersisted:
        step, ok, persist_s, nbytes = _row(row, 4, "checkpoint persisted")
        if not isinstance(ok, bool):
            raise TelemetryError(f"a persisted checkpoint's ok must be a boolean, got {ok!r:.40}")
        return cls(_int(step, "step"), ok, _seconds(persist_s, "persist_s"), _int(nbytes, "nbytes"))


@dataclasses.dataclass(frozen=True, slots=True)
class CaughtUp:
    """A catch-up from a peer: ``nbytes`` of state received, ``seconds`` from the fetch to loaded."""

    step: int
    seconds: float
    nbytes: int

    def to_row(self) -> list[Any]:
        return [self.step, self.seconds, self.nbytes]

    @classmethod
    def from_row(cls, row: Any) -> CaughtUp:
        step, seconds, nbytes = _row(row, 3, "caught up")
        return cls(_int(step, "step"), _seconds(seconds, "seconds"), _int(nbytes, "nbytes"))


SDC_WHAT = ("results", "weights", "rerun")


@dataclasses.dataclass(frozen=True, slots=True)
class SdcFound:
    """A verified exchange whose fingerprints differed (:mod:`unbroken.train.step.sdc_check`): at
    ``step`` of ``epoch``, ``what`` differed (the results, the weights, or a re-run named the
    first results' culprit), ``culprits`` named (may be empty), ``committed`` by this rank."""

    step: int
    epoch: int
    what: str
    culprits: list[int]
    committed: bool

    def to_row(self) -> list[Any]:
        return [self.step, self.epoch, self.what, self.culprits, self.committed]

    @classmethod
    def from_row(cls, row: Any) -> SdcFound:
        step, epoch, what, culprits, committed = _row(row, 5, "sdc")
        if what not in SDC_WHAT:
            raise TelemetryError(f"sdc: what must be one of {SDC_WHAT}, got {what!r:.40}")
        if not isinstance(culprits, list) or len(culprits) > MAX_MEMBERS:
            raise TelemetryError("sdc: culprits must be a list of replica ids")
        if not isinstance(committed, bool):
            raise TelemetryError("sdc: committed must be true or false")
        return cls(_int(step, "step"), _int(epoch, "epoch"), what, [_int(c, "culprit") for c in culprits], committed)


@dataclasses.dataclass(frozen=True)
class TelemetryBatch:
    """What one rank ships at once: everything new since its last batch, and what is open now."""

    now_ns: int  # the rank's monotonic clock when the batch was made (aligns its times)
    records: list[Collective] = dataclasses.field(default_factory=list)
    open: Collective | None = None
    links: list[Transfer] = dataclasses.field(default_factory=list)
    open_links: list[Transfer] = dataclasses.field(default_factory=list)
    stalls: list[Stall] = dataclasses.field(default_factory=list)
    steps: list[StepMetrics] = dataclasses.field(default_factory=list)
    flags: list[FlaggedLink] = dataclasses.field(default_factory=list)
    memory: float | None = None  # the process's resident bytes
    saved: list[CheckpointSaved] = dataclasses.field(default_factory=list)
    persisted: list[CheckpointPersisted] = dataclasses.field(default_factory=list)
    caught_up: list[CaughtUp] = dataclasses.field(default_factory=list)
    paths: list[PathEvent] = dataclasses.field(default_factory=list)
    sdc: list[SdcFound] = dataclasses.field(default_factory=list)

    def to_msg(self) -> dict[str, Any]:
        return {
            "now_ns": self.now_ns,
            "records": [r.to_row() for r in self.records],
            "open": None if self.open is None else self.open.to_row(),
            "links": [t.to_row() for t in self.links],
            "open_links": [t.to_row() for t in self.open_links],
            "stalls": [s.to_row() for s in self.stalls],
            "steps": [s.to_row() for s in self.steps],
            "flags": [f.to_row() for f in self.flags],
            "memory": self.memory,
            "saved": [x.to_row() for x in self.saved],
            "persisted": [x.to_row() for x in self.persisted],
            "caught_up": [x.to_row() for x in self.caught_up],
            "paths": [x.to_row() for x in self.paths],
            "sdc": [x.to_row() for x in self.sdc],
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> TelemetryBatch:
        """Raises:
        TelemetryError: a field is missing, of the wrong type, too long or out of range."""
        if not isinstance(msg, dict):
            raise TelemetryError("a telemetry batch must be a JSON object")
        opened = msg.get("open")
        memory = _number(msg.get("memory"), "memory")
        if memory is not None and not (math.isfinite(memory) and memory >= 0):
            raise TelemetryError(f"memory must be a finite number of bytes >= 0, got {memory!r:.40}")
        return cls(
            now_ns=_int(msg.get("now_ns"), "now_ns"),
            records=_rows(msg.get("records", []), "records", Collective),
            open=None if opened is None else Collective.from_row(opened),
            links=_rows(msg.get("links", []), "links", Transfer),
            open_links=_rows(msg.get("open_links", []), "open_links", Transfer),
            stalls=_rows(msg.get("stalls", []), "stalls", Stall),
            steps=_rows(msg.get("steps", []), "steps", StepMetrics),
            flags=_rows(msg.get("flags", []), "flags", FlaggedLink),
            memory=memory,
            saved=_rows(msg.get("saved", []), "saved", CheckpointSaved, MAX_COSTS),
            persisted=_rows(msg.get("persisted", []), "persisted", CheckpointPersisted, MAX_COSTS),
            caught_up=_rows(msg.get("caught_up", []), "caught_up", CaughtUp, MAX_COSTS),
            paths=_rows(msg.get("paths", []), "paths", PathEvent, MAX_COSTS),
            sdc=_rows(msg.get("sdc", []), "sdc", SdcFound, MAX_COSTS),
        )


def _row(row: Any, n: int, what: str) -> list[Any]:
    if not isinstance(row, list) or len(row) != n:
        raise TelemetryError(f"a {what} record must be a list of {n} fields, got {row!r:.60}")
    return row


def _rows(rows: Any, what: str, kind: Any, limit: int = MAX_ROWS) -> list[Any]:
    if not isinstance(rows, list) or len(rows) > limit:
        raise TelemetryError(f"{what} must be a list of at most {limit} records")
    return [kind.from_row(r) for r in rows]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_NS:
        raise TelemetryError(f"{what} must be an integer from 0 to 2**63, got {value!r:.40}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise TelemetryError(f"{what} must be a string of at most {MAX_TEXT} characters, got {value!r:.40}")
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
        raise TelemetryError(f"{what} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r:.40}")
    return float(value)


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TelemetryError(f"{what} must be a number or null, got {value!r:.40}")
    return float(value)
