"""The parts split out of the supervisor, built through their constructors with no launcher.

No process is started: the faults fired here are worker faults (recorded, applied by the
worker), and the rollbacks asked for are refused or find no checkpoint, as a user would see.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from unbroken.faults.schedule import Fault, Schedule
from unbroken.launch.lifecycle import Lifecycle
from unbroken.launch.recovery.fault_firing import FaultFiring
from unbroken.launch.recovery.rollback import Rollback
from unbroken.launch.workers import SupervisedReplica
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog


def _log() -> tuple[EventLog, list[ev.Event]]:
    log = EventLog(None, "launcher")
    seen: list[ev.Event] = []
    log.subscribe(seen.append)
    return log, seen


async def _drain(coros: list[Coroutine[Any, Any, None]]) -> None:
    while coros:
        await coros.pop(0)


def test_each_fault_fires_once_when_due_and_slowness_left_is_handed_on() -> None:
    schedule = Schedule(
        (
            Fault("slow_rank", step=5, replica=1, factor=3.0, duration_s=100.0),
            Fault("nan_loss", step=9, replica=0),
        )
    )
    log, seen = _log()
    coros: list[Coroutine[Any, Any, None]] = []

    def no_procs(replica: int) -> list[asyncio.subprocess.Process]:
        raise AssertionError("a worker fault touches no process")

    async def no_restart(down_s: float) -> str:
        raise AssertionError("no coordinator_kill in this schedule")

    firing = FaultFiring(schedule, log, no_procs, lambda: 6, no_restart, coros.append)
    firing.fire_due(4, 0.0)
    assert not coros  # not due yet
    for _ in range(3):  # due at step 6, fired once however often the monitor asks
        firing.fire_due(6, 1.0)
    asyncio.run(_drain(coros))
    injected = [e for e in seen if isinstance(e, ev.FaultInjected)]
    assert [(e.fault, e.fault_kind, e.applied_by, e.step) for e in injected] == [(0, "slow_rank", "worker", 6)]

    now = time.time()
    left = firing.slow_faults_on(1, now + 40.0)
    assert len(left) == 1 and left[0].step == 0 and 59.0 < (left[0].duration_s or 0) <= 60.0
    assert firing.slow_faults_on(0, now) == []  # replica 0's fault is not a slowness
    assert firing.slow_faults_on(1, now + 101.0) == []  # over


def _verdict(**evidence: Any) -> ev.Verdict:
    return ev.Verdict(
        verdict_class="metric_anomaly",
        culprit={"replica": 1, "rank": 0, "node": None, "link": None},
        confidence=0.9,
        evidence={"action": "rollback", **evidence},
    )


def _rollback(checkpoint_dir: Path | None) -> tuple[Rollback, list[ev.Event], list[Coroutine[Any, Any, None]]]:
    log, seen = _log()
    coros: list[Coroutine[Any, Any, None]] = []
    replicas = {r: SupervisedReplica(r) for r in range(2)}

    def fail(r: SupervisedReplica, reason: str) -> None:
        raise AssertionError(f"nothing to roll back, yet replica {r.replica} failed: {reason}")

    rollback = Rollback(checkpoint_dir, log, replicas, Lifecycle(2, time.time()), fail, lambda: False, coros.append)
    return rollback, seen, coros


def _ignored(seen: list[ev.Event]) -> list[str]:
    return [e.reason for e in seen if isinstance(e, ev.VerdictIgnored) and e.action == "rollback"]


def test_a_rollback_without_a_checkpoint_directory_or_a_step_is_refused_with_the_reason() -> None:
    rollback, seen, coros = _rollback(None)
    rollback.start(_verdict(step=7), "metric_anomaly: rollback")
    assert _ignored(seen) == ["no checkpoint directory to roll back to (unbroken run --checkpoint-dir)"]

    rollback, seen, coros = _rollback(Path("/nonexistent"))
    rollback.start(_verdict(step="7"), "metric_anomaly: rollback")
    assert _ignored(seen) == ["the verdict names no step"] and not coros


def test_one_rollback_at_a_time_and_none_without_a_loadable_checkpoint(tmp_path: Path) -> None:
    rollback, seen, coros = _rollback(tmp_path)
    rollback.start(_verdict(step=7), "metric_anomaly: rollback")
    rollback.start(_verdict(step=8), "metric_anomaly: rollback")  # while the first is verified
    assert _ignored(seen) == ["a rollback is under way"] and len(coros) == 1
    asyncio.run(_drain(coros))
    assert _ignored(seen)[1] == f"no loadable checkpoint at or before step 7 in {tmp_path}"
    assert not any(isinstance(e, (ev.Rollback, ev.VerdictActed)) for e in seen)
    rollback.start(_verdict(step=9), "metric_anomaly: rollback")  # the refusal ended the first
    assert len(coros) == 1
    asyncio.run(_drain(coros))
