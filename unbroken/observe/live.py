"""What a running job looks like now: the typed events and the replicas' metrics rows, folded.

:class:`JobView` reads the run directory's event log and the replicas' ``metrics-r*.jsonl``
rows incrementally (each call reads only what was appended since the last), so the service
that serves ``/metrics`` and the dashboard (:mod:`unbroken.observe.http`) does its work in its
own thread, on request, and the coordinator's event loop and the training processes do none:
reading files another process appends to costs them nothing.

The coordinator's live answer (membership, epoch, each replica's step and step time) comes
from its ``status()`` and is passed in; the rest (lifecycle states, restarts by cause,
detection and recovery times, verdicts, goodput) is a pure function of the events and rows.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unbroken.observe import goodput as gp
from unbroken.observe import schema as ev
from unbroken.observe.events import rotated_files

# Seconds: the histograms' buckets (detection is sub-second to tens of seconds; a recovery
# spans a process start and a catch-up).
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A checkpoint's stall is milliseconds when it is working as designed (a copy to host memory).
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
MAX_PORTS = 1024  # NIC ports named by port verdicts that the view keeps
TIMELINE_KINDS = (
    ev.Quorum,
    ev.FaultInjected,
    ev.FaultCleared,
    ev.Verdict,
    ev.ReplicaEvicted,
    ev.ProcessExited,
    ev.NodeIsolated,
    ev.Rollback,
    ev.CoordinatorRestarted,
    ev.JobFinished,
    ev.JobFailed,
)
# The events goodput accounting reads (all others are left out of its copy of the history).
GOODPUT_KINDS = frozenset({"quorum", "replica_state", "fault_injected", "coordinator_restarted", *gp.DETECTION_KINDS})


class JsonlTail:
    """Reads the complete lines appended to a file since the last call (a torn last line waits).

    A rotated file (:class:`~unbroken.observe.events.EventLog` renames a full log to ``.1``) is
    read to its end, then the new file from its start; a file truncated in place is read again
    from its start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""
        self._ino: tuple[int, int] | None = None

    def read(self, max_bytes: int = 1 << 24) -> list[dict[str, Any]]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        out: list[dict[str, Any]] = []
        with f:
            st = os.fstat(f.fileno())
            ino = (st.st_ino, st.st_dev)
            if ino != self._ino:  # rotated since the last read, or the first read: older files first
                out += self._finish_rotated(max_bytes)
                self._offset, self._rest = 0, b""
            elif st.st_size < self._offset:
                self._offset, self._rest = 0, b""
            self._ino = ino
            f.seek(self._offset)
            data = f.read(max_bytes)
        self._offset += len(data)
        return out + self._lines(data)

    def _finish_rotated(self, max_bytes: int) -> list[dict[str, Any]]:
        """The rest of the file this tail was reading, now under a rotated name, and any file
        rotated after it, whole (when several rotations passed between two reads); on the first
        read, every rotated file."""
        olds = rotated_files(self.path)  # oldest first
        out: list[dict[str, Any]] = []
        found = self._ino is None
        for old in olds:
            try:
                with open(old, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not found and (st.st_ino, st.st_dev) != self._ino:
                        continue
                    f.seek(self._offset if not found else 0)
                    data = f.read(max_bytes)
            except OSError:
                continue
            found = True
            # Its last line is complete: writers append to the path's new file now.
            out += self._lines(data + b"\n")
            self._rest = b""
        return out

    def _lines(self, data: bytes) -> list[dict[str, Any]]:
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


@dataclasses.dataclass
class ReplicaView:
    replica: int
    state: str = ""  # no lifecycle event yet (or none at all: a coordinator run on its own)
    since: float = 0.0
    history: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    node: str = ""
    restarts: int = 0
    failed_at: float | None = None
    caught_up_from: float | None = None
    last_event: str = ""


class Histogram:
    """Cumulative bucket counts, a sum and a count, as Prometheus wants them."""

    def __init__(self, buckets: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*[f"{b:g}" for b in self.buckets], "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class JobView:
    """The job as the dashboard and ``/metrics`` show it; safe to call from any thread.

    Args:
        run_dir: where ``events_name`` and the replicas' ``metrics-r*.jsonl`` are written.
        events_name: the event log's file name (``events.jsonl``; ``events-NODE.jsonl`` for an agent).
        replicas: the job's configured replicas, when known before its first event says it.
        max_points: per replica, the newest rows kept for the loss and step-time plots.
    """

    def __init__(
        self, run_dir: Path, events_name: str = "events.jsonl", replicas: int | None = None, max_points: int = 600
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total = replicas
        self.max_points = max_points
        self._lock = threading.Lock()
        self._events = JsonlTail(self.run_dir / events_name)
        self._rows: dict[int, JsonlTail] = {}
        self.replicas: dict[int, ReplicaView] = {}
        self.timeline: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        self.points: dict[int, collections.deque[tuple[int, float | None, float]]] = {}
        self.restarts: collections.Counter[str] = collections.Counter()
        self.verdicts: collections.Counter[str] = collections.Counter()
        # (host, interface, peer) -> the last port verdict's state and failures (ICCL's NIC ports)
        self.ports: dict[tuple[str, str, int], tuple[str, int]] = {}
        self.detection = Histogram()
        self.recovery = Histogram()
        self.catch_up = Histogram()
        self.checkpoint_stall = Histogram(STALL_BUCKETS)
        self.checkpoint_persist = Histogram()
        self.catch_up_transfer = Histogram()
        # counters: bytes and counts by what they are
        self.totals: collections.Counter[str] = collections.Counter()
        self.events_read = 0
        self.job: dict[str, Any] = {}
        self._goodput_events: list[dict[str, Any]] = []
        self._goodput_rows: dict[int, list[dict[str, Any]]] = {}
        self._faults_open: list[dict[str, Any]] = []  # injected, not yet detected
        self._goodput: tuple[float, gp.Goodput | None] = (0.0, None)

    # -- reading ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Folds in what was appended to the event log and the metrics rows since the last call."""
        with self._lock:
            for record in self._events.read():
                event = ev.parse(record)
                if event is not None:
                    self._fold(event, record)
            for r in self._known_replicas():
                tail = self._rows.setdefault(r, JsonlTail(self.run_dir / f"metrics-r{r}.jsonl"))
                for row in tail.read():
                    self._row(r, row)

    def _known_replicas(self) -> list[int]:
        known = set(self.replicas)
        if self.total is not None:
            known |= set(range(self.total))
        return sorted(known)

    def _replica(self, r: int) -> ReplicaView:
        view = self.replicas.get(r)
        if view is None:
            view = self.replicas[r] = ReplicaView(r)
        return view

    def _fold(self, e: ev.Event, record: Mapping[str, Any]) -> None:
        self.events_read += 1
        if e.KIND in GOODPUT_KINDS:
            self._goodput_events.append(dict(record))
        if isinstance(e, TIMELINE_KINDS):
            self.timeline.append(_timeline_entry(e))
        if isinstance(e, ev.JobStarted):
            self.total = e.replicas
            self.job.update(started=e.t, coordinator=e.coordinator)
        elif isinstance(e, ev.ReplicaState):
            self._state(self._replica(e.replica), e.new, e.t, f"{e.new}: {e.reason}")
        elif isinstance(e, ev.ProcessStarted):
            view = self._replica(e.replica)
            view.node = e.node
            if e.source.startswith("agent:"):  # an agent has no lifecycle of its own: processes tell
                self._state(view, "training", e.t, f"process started (restart {e.restart})")
        elif isinstance(e, ev.ProcessExited):
            view = self._replica(e.replica)
            view.last_event = f"exited with code {e.exitcode}: {e.action}"
            if e.source.startswith("agent:"):
                self._state(view, "failed", e.t, view.last_event)
        elif isinstance(e, ev.RestartDecision) and e.action == "restart":
            self.restarts[e.failure.value] += 1
            self._replica(e.replica).restarts += 1
        elif isinstance(e, ev.ReplicaRestarting) and e.source.startswith("agent:"):
            self.restarts[ev.FailureCause.PROCESS_EXIT.value] += 1
            self._replica(e.replica).restarts += 1
        elif isinstance(e, ev.Verdict):
            self.verdicts[e.verdict_class] += 1
            if e.verdict_class == "port_failure":
                ev_ = e.evidence
                port = (str(ev_.get("host")), str(ev_.get("interface")), int(ev_.get("peer", -1)))
                if port in self.ports or len(self.ports) < MAX_PORTS:
                    self.ports[port] = (str(ev_.get("state")), int(ev_.get("failures", 0)))
        elif isinstance(e, ev.FaultInjected):
            self._faults_open.append(dict(record))
        elif isinstance(e, ev.Quorum):
            self.job.update(epoch=e.epoch, epoch_step=e.step, members=e.members)
        elif isinstance(e, ev.JobFailed):
            self.job["failed"] = {"reason": e.reason, "exit_code": e.exit_code, "cause": e.cause, "hint": e.hint}
        elif isinstance(e, ev.CheckpointSaved):
            self.checkpoint_stall.observe(e.stall_s)
            self.totals["checkpoint_snapshot_bytes"] += e.nbytes
        elif isinstance(e, ev.CheckpointPersisted):
            self.totals["checkpoint_persisted_ok" if e.ok else "checkpoint_persisted_failed"] += 1
            if e.ok:
                self.checkpoint_persist.observe(e.persist_s)
                self.totals["checkpoint_persisted_bytes"] += e.nbytes
        elif isinstance(e, ev.CaughtUp):
            self.catch_up_transfer.observe(e.seconds)
            self.totals["catch_up_bytes"] += e.nbytes
        if self._faults_open and e.KIND in gp.DETECTION_KINDS:
            detected = [(f, hit) for f, hit in gp.detections([*self._faults_open, dict(record)]) if hit is not None]
            for fault, hit in detected:
                self.detection.observe(max(0.0, hit["t"] - fault["t"]))
            self._faults_open = [f for f in self._faults_open if all(f is not d for d, _ in detected)]

    def _state(self, view: ReplicaView, new: str, t: float, note: str) -> None:
        if new == "failed" and view.failed_at is None:
            view.failed_at = t
        if new == "catching_up":
            view.caught_up_from = t
        if new == "training":
            if view.failed_at is not None:
                self.recovery.observe(max(0.0, t - view.failed_at))
            if view.caught_up_from is not None:
                self.catch_up.observe(max(0.0, t - view.caught_up_from))
            view.failed_at = view.caught_up_from = None
        view.state, view.since, view.last_event = new, t, note
        view.history.append((t, new))
        del view.history[:-20]

    def _row(self, r: int, row: Mapping[str, Any]) -> None:
        step, t, step_s = row.get("step"), row.get("t"), row.get("step_s")
        if not isinstance(step, int) or not isinstance(t, (int, float)) or not isinstance(step_s, (int, float)):
            return  # not a step's row (a script's own line)
        loss = row.get("loss")
        loss = float(loss) if isinstance(loss, (int, float)) else None
        committed = bool(row.get("committed"))
        if committed:
            points = self.points.setdefault(r, collections.deque(maxlen=self.max_points))
            while points and points[-1][0] >= step:  # a restarted process redoes steps: a plot goes forward
                points.pop()
            points.append((step, loss, float(step_s)))
        rows = self._goodput_rows.setdefault(r, [])
        rows.append({"t": t, "step_s": float(step_s), "committed": committed, "recovered": bool(row.get("recovered"))})

    # -- what is shown ----------------------------------------------------------------------

    def goodput(self, max_age_s: float = 2.0) -> gp.Goodput | None:
        """Goodput so far (recomputed over the whole history at most every ``max_age_s``)."""
        with self._lock:
            at, cached = self._goodput
            if cached is not None and time.monotonic() - at < max_age_s:
                return cached
            total = self.total or len(self.replicas)
            if not total:
                return None
            result = gp.account(self._goodput_events, self._goodput_rows, total)
            self._goodput = (time.monotonic(), result)
            return result

    def state(self, status: Mapping[str, Any] | None) -> dict[str, Any]:
        """The dashboard's JSON: job, replicas, timeline, plots, goodput."""
        good = self.goodput()
        with self._lock:
            live = {int(k): v for k, v in ((status or {}).get("replicas") or {}).items()}
            members = set((status or {}).get("members") or self.job.get("members") or [])
            replicas = []
            for r in sorted(set(self._known_replicas()) | set(live)):
                view = self.replicas.get(r) or ReplicaView(r)
                info = live.get(r, {})
                state = view.state or ("member" if r in members else ("connected" if info else "launching"))
                replicas.append(
                    {
                        "replica": r,
                        "state": state,
                        "history": [s for _, s in view.history],
                        "since": view.since,
                        "node": info.get("node") or view.node,
                        "member": r in members,
                        "step": info.get("step"),
                        "step_s": info.get("compute_s"),
                        "restarts": view.restarts,
                        "last_event": view.last_event,
                    }
                )
            steps = [x["step"] for x in replicas if isinstance(x["step"], int)]
            return {
                "t": time.time(),
                "job": {
                    "epoch": (status or {}).get("epoch", self.job.get("epoch")),
                    "step": max(steps) if steps else None,
                    "members": sorted(members),
                    "total": self.total or len(replicas),
                    "healthy": sum(1 for x in replicas if x["state"] == "training"),
                    "coordinator": status is not None,
                    "failed": (status or {}).get("job_failed") or self.job.get("failed"),
                },
                "replicas": replicas,
                "timeline": list(self.timeline)[-60:],
                "series": {str(r): list(p) for r, p in self.points.items()},
                "goodput": good.to_json() if good is not None else None,
                "verdicts": dict(self.verdicts),
                "ports": [
                    {"host": h, "interface": i, "peer": p, "state": s, "failures": n}
                    for (h, i, p), (s, n) in sorted(self.ports.items())
                ],
                "restarts": dict(self.restarts),
            }


def _timeline_entry(e: ev.Event) -> dict[str, Any]:
    """One line of the dashboard's timeline: when, what, and a short text."""
    if isinstance(e, ev.Quorum):
        text = f"epoch {e.epoch} at step {e.step}: members {e.members}" + (f", behind {e.behind}" if e.behind else "")
    elif isinstance(e, ev.FaultInjected):
        text = f"fault {e.fault_kind} injected on replica {e.replica}" + (f" (pid {e.pid})" if e.pid else "")
    elif isinstance(e, ev.FaultCleared):
        text = f"fault {e.fault_kind} on replica {e.replica} cleared"
    elif isinstance(e, ev.Verdict):
        text = f"verdict {e.verdict_class} on {e.culprit} (confidence {e.confidence:.2f})"
    elif isinstance(e, ev.ReplicaEvicted):
        text = f"replica {e.replica} evicted: {e.cause.value}"
    elif isinstance(e, ev.ProcessExited):
        text = f"replica {e.replica} rank {e.rank} exited with code {e.exitcode}: {e.action}"
    elif isinstance(e, ev.NodeIsolated):
        text = f"node {e.node} isolated: {e.reason}"
    elif isinstance(e, ev.Rollback):
        text = f"rollback to step {e.step}"
    elif isinstance(e, ev.JobFailed):
        text = f"job failed (exit {e.exit_code}): {e.reason}"
    else:
        text = e.KIND.replace("_", " ")
    return {"t": e.t, "kind": e.KIND, "text": text}
