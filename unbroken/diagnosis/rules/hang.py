"""Hang classes from the ranks' progress at one collective group (C4D's comparison).

Ranks of a data-parallel exchange meet at every collective, so their sequence counters move in
lock-step. When they stop:

- one rank's counter lags while the others wait at the next collective: the lagging rank is
  stuck outside communication (a non-communication hang); it is the culprit;
- every counter is equal and nobody completes: the exchange itself is stuck (a communication
  hang); the earliest stalled transfer of the ring names the link, because every later stall
  is a consequence of it;
- a rank inside the collective whose telemetry has gone silent is not running at all (a stopped
  or frozen process): a non-communication fault of that rank, whatever its counter says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from unbroken.diagnosis.verdict import COMM_HANG, NONCOMM_HANG, UNKNOWN_REPLICA, Culprit


@dataclasses.dataclass(frozen=True)
class OpenTransfer:
    """A receive posted in the ring and not completed: ``sender`` -> this rank."""

    sender: int
    step: int
    age_s: float


@dataclasses.dataclass(frozen=True)
class RankView:
    """What the coordinator knows about one member at one group.

    Attributes:
        entered: highest sequence number this rank entered on the group (-1: none).
        wait_s: how long it has waited at ``entered`` without success (None: it completed it,
            or is not in a collective).
        silent_s: time since this rank's last telemetry.
        open_recvs: its ring receives still outstanding.
        furthest_step: the furthest ring step of its transfers still open, sends or receives
            (None: none reported): how far it got in the ring.
        done: the highest sequence number it completed on the group (-1: none).
    """

    replica: int
    rank: int
    node: str
    entered: int
    wait_s: float | None
    silent_s: float
    open_recvs: tuple[OpenTransfer, ...] = ()
    furthest_step: int | None = None
    done: int = -1


@dataclasses.dataclass(frozen=True)
class HangFinding:
    kind: str
    culprit: Culprit
    confidence: float
    evidence: dict[str, Any]


def classify_hang(group: str, views: list[RankView], hang_s: float, silent_s: float) -> HangFinding | None:
    """Names the hung rank or link of ``group``, or None while nobody has waited ``hang_s``.

    Args:
        hang_s: a wait longer than this is a hang (learned from healthy waits and steps).
        silent_s: telemetry absent this long means the process is not running.
    """
    waiting = [v for v in views if v.wait_s is not None and v.wait_s >= hang_s]
    if not waiting or len(views) < 2:
        return None
    if all(v.silent_s >= silent_s for v in views):
        return None  # nobody is talking: the job ended or the coordinator itself stalled
    top = max(v.entered for v in views)
    evidence: dict[str, Any] = {
        "group": group,
        "hang_threshold_s": round(hang_s, 3),
        "seq": {str(v.replica): v.entered for v in views},
        "waiting_s": {str(v.replica): round(v.wait_s, 3) for v in views if v.wait_s is not None},
        "silent_s": {str(v.replica): round(v.silent_s, 3) for v in views},
    }
    laggers = sorted((v for v in views if v.entered < top), key=lambda v: v.entered)
    if any(v.wait_s is not None and v.furthest_step is not None and v.silent_s < silent_s for v in laggers):
        # A lagging rank still inside its collective with ring transfers open is waiting on
        # the network, not stuck outside it: its peers finished that collective and their data
        # to it is late (a lossy link: in the box at 5% loss on one host this named a healthy
        # replica). Not a non-communication hang; the collective's deadline record names the
        # transfer if it never completes.
        return None
    if laggers:
        v = laggers[0]
        evidence["reason"] = f"replica {v.replica} is at seq {v.entered} while others wait at seq {top}"
        if v.silent_s >= silent_s:
            evidence["reason"] += " and its telemetry is silent (process not running)"
        conf = 0.95 if len(laggers) == 1 else 0.6
        return HangFinding(NONCOMM_HANG, Culprit(v.replica, v.rank, v.node), conf, evidence)
    latest = min((v.wait_s for v in views if v.wait_s is not None), default=None)
    if latest is not None and latest < hang_s and all(v.wait_s is not None for v in views):
        # Every rank is in the collective, the last one only just arrived: the others waited for
        # it (a late start, a newcomer's first step), and the collective itself is young.
        return None
    silent = sorted((v for v in views if v.silent_s >= silent_s), key=lambda v: -v.silent_s)
    if silent and len(silent) < len(views):
        v = silent[0]
        evidence["reason"] = (
            f"every rank is at seq {top} but replica {v.replica} has sent no telemetry "
            f"for {v.silent_s:.2f}s: its process is not running"
        )
        return HangFinding(NONCOMM_HANG, Culprit(v.replica, v.rank, v.node), 0.85, evidence)
    stalls = [(t.step, -t.age_s, t.sender, v) for v in views for t in v.open_recvs]
    if stalls:
        step, neg_age, sender, receiver = min(stalls, key=lambda s: (s[0], s[1]))
        behind = next((v for v in views if v.replica == sender), None)
        if behind is not None and behind.done < top and (behind.furthest_step is None or behind.furthest_step < step):
            # The sender has neither completed the collective nor shown a transfer of that ring
            # step: it may still be at an earlier one, whose own stall its telemetry has not
            # shown yet (twice in 40 hang_comm runs, 1 -> 2 at step 1 was named while 1 waited on
            # 0 -> 1 at step 0). A stall there is a consequence; wait for the sender's evidence
            # (or the deadline's record) to name it.
            return None
        evidence["open_recvs"] = [
            {"sender": t.sender, "receiver": v.replica, "ring_step": t.step, "age_s": round(t.age_s, 3)}
            for v in views
            for t in v.open_recvs
        ]
        evidence["reason"] = (
            f"every rank is in seq {top}; the earliest stalled transfer is "
            f"{sender} -> {receiver} at ring step {step} ({-neg_age:.2f}s)"
        )
        node = next((v.node for v in views if v.replica == sender), None)
        return HangFinding(COMM_HANG, Culprit(sender, receiver.rank, node, (sender, receiver.replica)), 0.9, evidence)
    if any(v.wait_s is None for v in views):
        # Some ranks completed seq ``top`` and others still wait in it, and no transfer timing
        # says which data is missing: the waiter may be a process the busy host has not run since
        # its data came (a backend job under two busy loops at load 11: one rank 0.70 s "waiting"
        # in a collective both peers had completed, named comm_hang with no culprit). A real stall
        # holds the peers at the next collective, which the counters then show.
        return None
    evidence["reason"] = f"every rank is in seq {top} and none completes; no per-connection timings to name a link"
    return HangFinding(COMM_HANG, Culprit(UNKNOWN_REPLICA), 0.4, evidence)
