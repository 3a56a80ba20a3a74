"""What the supervisor does about a diagnosis verdict (pure; the launcher applies it).

Each verdict class has its own remedy, and ``--on-verdict`` caps it (``ignore`` < ``restart``
< ``isolate``):

- ``noncomm_hang`` / ``comm_hang`` naming a replica: ``restart``. A hung process is usually
  software (a deadlock, a stuck read); killing it frees the exchange, and a node that hangs
  again and again is isolated by the blame policy of :mod:`unbroken.launch.policy`.
- ``straggler`` and ``comm_slow`` naming a node, sender or receiver: ``isolate``. Slowness
  stays with the hardware, so the replica moves to a spare slot (or restarts in place when no
  spare is free).
- ``metric_anomaly``: what the anomaly policy asked for in the verdict's ``evidence.action``:
  ``isolate`` isolates; ``rollback`` restarts every replica from the newest checkpoint saved
  before the anomalous step (:func:`rollback_step`) that loads (the launcher reads every
  checksum of a candidate before acting, newest first): by the time a spike is judged its
  gradient has been averaged into every replica, so no single replica's state is good;
  ``skip_step`` and ``none`` were already handled inside the worker, so the supervisor does
  nothing.
- ``suspect_hardware`` (a replica named for silent data corruption again within a window):
  ``isolate``, and only that: its node is set aside and the replica moves to a spare slot.
  Each corruption was already healed from a peer, so without a spare slot (or with
  ``--on-verdict`` below ``isolate``) the replica stays where it is: a restart in place would
  cost a catch-up and mend nothing.
- a verdict about a *link* (``culprit.link`` set with no single guilty node), or one that names
  no replica (``culprit.replica`` -1 or missing): nothing. Killing either end does not mend a
  link; the exchange's deadline abandons the stuck collective and the verdict is the evidence
  for whoever fixes the network.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unbroken.diagnosis.verdict import (
    COMM_HANG,
    COMM_SLOW,
    METRIC_ANOMALY,
    NONCOMM_HANG,
    PORT_FAILURE,
    STRAGGLER,
    SUSPECT_HARDWARE,
)
from unbroken.observe import schema as ev

ISOLATE, RESTART, IGNORE, ROLLBACK = "isolate", "restart", "ignore", "rollback"
VERDICT_ACTIONS = (ISOLATE, RESTART, IGNORE)  # what --on-verdict may cap them at
_STRENGTH = {IGNORE: 0, RESTART: 1, ROLLBACK: 1, ISOLATE: 2}
CLASS_ACTIONS: dict[str, str] = {
    NONCOMM_HANG: RESTART,
    COMM_HANG: RESTART,
    STRAGGLER: ISOLATE,
    COMM_SLOW: ISOLATE,
    PORT_FAILURE: IGNORE,  # its ICCL hop moved to the backup path: evidence and a metric, nothing to mend here
    SUSPECT_HARDWARE: ISOLATE,  # set aside: moved off the hardware that corrupted again (only to a spare slot)
}
_METRIC_ACTIONS = {"isolate": ISOLATE, "rollback": ROLLBACK}


def _culprit(verdict: ev.Verdict) -> dict[str, Any]:
    return verdict.culprit if isinstance(verdict.culprit, dict) else {}


def _evidence(verdict: ev.Verdict) -> dict[str, Any]:
    return verdict.evidence if isinstance(verdict.evidence, dict) else {}


def culprit_replica(verdict: ev.Verdict) -> Any:
    """The replica the verdict names, as it came (an int for a real one; check before use)."""
    return _culprit(verdict).get("replica")


def anomaly_step(verdict: ev.Verdict) -> int | None:
    """The step of a ``metric_anomaly`` verdict's anomaly; None when it names none."""
    step = _evidence(verdict).get("step")
    return step if isinstance(step, int) else None


def anomaly(verdict: ev.Verdict) -> Any:
    """The anomaly a ``metric_anomaly`` verdict describes (its ``evidence.anomaly``)."""
    return _evidence(verdict).get("anomaly")


def verdict_action(verdict: ev.Verdict, on_verdict: str, spare_free: bool = True) -> tuple[str, str]:
    """The action for one ``verdict`` event and why: (``isolate``|``restart``|``ignore``, reason).

    ``rollback`` acts on the whole job, not on the culprit (see the module doc).

    Args:
        verdict: the event (its class, culprit and evidence).
        on_verdict: the strongest action the user allows (``--on-verdict``).
        spare_free: whether a spare slot is free to move a replica to.
    """
    if on_verdict not in _STRENGTH:
        raise ValueError(f"--on-verdict must be one of {', '.join(VERDICT_ACTIONS)}, got {on_verdict!r}")
    kind = verdict.verdict_class
    culprit, evidence = _culprit(verdict), _evidence(verdict)
    replica = culprit.get("replica")
    if not isinstance(replica, int) or replica < 0:
        return IGNORE, "the verdict names no replica"
    if culprit.get("link") is not None and (kind == COMM_HANG or evidence.get("pattern") == "link"):
        return IGNORE, "a link is at fault: restarting either end does not mend it"
    if kind == METRIC_ANOMALY:
        asked = evidence.get("action")
        wanted = _METRIC_ACTIONS.get(str(asked), IGNORE)
        if wanted == IGNORE:
            return IGNORE, f"anomaly policy action {asked!r} is handled in the worker"
    elif kind in CLASS_ACTIONS:
        wanted = CLASS_ACTIONS[kind]
    else:
        return IGNORE, f"unknown verdict class {kind!r}"
    if kind == SUSPECT_HARDWARE and (_STRENGTH[on_verdict] < _STRENGTH[ISOLATE] or not spare_free):
        why = f"--on-verdict {on_verdict}" if _STRENGTH[on_verdict] < _STRENGTH[ISOLATE] else "no spare slot is free"
        return IGNORE, f"{kind}: the replica stays ({why}); each corruption was healed from a peer"
    if _STRENGTH[on_verdict] < _STRENGTH[wanted]:
        return on_verdict, f"{kind} calls for {wanted}, capped by --on-verdict {on_verdict}"
    return wanted, f"{kind}: {wanted}"


def rollback_step(anomaly_step: int, checkpoint_steps: Iterable[int]) -> int | None:
    """The checkpoint to roll back to: the newest one saved before the anomalous update.

    A checkpoint labelled ``s`` holds the state after ``s`` steps, that is before step ``s``'s
    update; the anomaly of step ``s`` came with that update, so checkpoint ``s`` is still good.
    None when no checkpoint is that old.
    """
    return max((s for s in checkpoint_steps if s <= anomaly_step), default=None)
