"""Goodput accounting: how much of the job's capacity trained the model, and where the rest went.

A pure function over the event log and the replicas' metrics rows. Capacity is replica-seconds
over the training window (first quorum to the last step any replica reports). Productive time
counts, per replica, every step it committed as a contributing member, each at most the run's
median committed step time: a stalled or slowed step counts only what a normal step costs, and
since no replica can commit more step-time than it spent, goodput never exceeds 1. (A fixed
"fault-free step time" taken before the first fault would not do on a shared machine: with a
replica missing, the others get more CPU and step faster than before.) The lost time is split, all in replica-seconds:

* detection: from each injected fault to the event that detected it, times the replicas (a
  hung or slowed peer holds every replica back until it is detected);
* recovery: time replicas spent failed or restarting (``failed``/``recovering`` states);
* catch_up: time in ``catching_up`` (joined behind, loading a donor's state);
* redone: steps attempted and discarded (an exchange that failed and was redone);
* isolated: time a replica waited without a slot or was stopped;
* other: what remains (start-up of restarted processes competing for CPU, slowdown
  outside detection, quorum waits).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]
Row = Mapping[str, Any]

# A restarted coordinator is what detects its own kill (a fault with no replica target).
DETECTION_KINDS = (
    "process_exited",
    "replica_evicted",
    "verdict",
    "restart_decision",
    "coordinator_restarted",
    "sdc_detected",  # names its culprits: a flipped bit is found by the verified exchange, not by silence
)


@dataclasses.dataclass(frozen=True)
class Goodput:
    goodput: float
    window_s: float
    capacity_s: float
    productive_s: float
    baseline_step_s: float
    lost_s: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput": round(self.goodput, 4),
            "window_s": round(self.window_s, 2),
            "capacity_s": round(self.capacity_s, 2),
            "productive_s": round(self.productive_s, 2),
            "baseline_step_s": round(self.baseline_step_s, 4),
            "lost_s": {k: round(v, 2) for k, v in self.lost_s.items()},
        }


def _state_time(events: Sequence[Event], replicas: int, t0: float, t1: float) -> dict[str, float]:
    """Replica-seconds spent in each lifecycle state within [t0, t1]."""
    out: dict[str, float] = {}
    for r in range(replicas):
        moves = sorted((e["t"], e["new"]) for e in events if e["kind"] == "replica_state" and e["replica"] == r)
        state, since = "launching", t0
        for t, new in moves + [(t1, None)]:
            a, b = max(since, t0), min(t, t1)
            if b > a:
                out[state] = out.get(state, 0.0) + (b - a)
            if new is not None:
                state, since = new, t
    return out


def detections(events: Sequence[Event]) -> list[tuple[Event, Event | None]]:
    """Each injected fault with the first later event that detected its target, if any."""
    out = []
    for f in (e for e in events if e["kind"] == "fault_injected"):
        targets = set(f.get("link") or ([f["replica"]] if f.get("replica") is not None else []))
        hit = None
        for e in events:
            if e["t"] < f["t"] or e["kind"] not in DETECTION_KINDS:
                continue
            if e["kind"] == "sdc_detected":
                named = set(e.get("culprits") or ())
            elif e["kind"] == "verdict":
                named = {(e.get("culprit") or {}).get("replica")}
            else:
                named = {e.get("replica")}
            if named & targets or (not targets and e["kind"] == "coordinator_restarted"):
                hit = e
                break
        out.append((f, hit))
    return out


def account(events: Sequence[Event], metrics: Mapping[int, Sequence[Row]], replicas: int) -> Goodput:
    """The goodput of one run and its lost time by cause."""
    quorums = [e["t"] for e in events if e["kind"] == "quorum"]
    rows = [row for rs in metrics.values() for row in rs]
    if not quorums or not rows:
        return Goodput(0.0, 0.0, 0.0, 0.0, 0.0, {})
    t0, t1 = min(quorums), max(row["t"] for row in rows)
    baseline = statistics.median([row["step_s"] for row in rows if row["committed"] and row["t"] > t0] or [0.0])
    productive = sum(
        min(row["step_s"], baseline)
        for row in rows
        if row["committed"] and not row.get("recovered") and t0 <= row["t"] <= t1
    )
    window = t1 - t0
    capacity = replicas * window
    states = _state_time(events, replicas, t0, t1)
    detect = sum(max(0.0, hit["t"] - f["t"]) * replicas for f, hit in detections(events) if hit is not None)
    lost = {
        "detection": detect,
        "recovery": states.get("failed", 0.0) + states.get("recovering", 0.0),
        "catch_up": states.get("catching_up", 0.0),
        "redone": sum(row["step_s"] for row in rows if not row["committed"]),
        "isolated": states.get("isolated", 0.0) + states.get("stopped", 0.0),
    }
    lost["other"] = max(0.0, capacity - productive - sum(lost.values()))
    return Goodput(productive / capacity if capacity else 0.0, window, capacity, productive, baseline, lost)
