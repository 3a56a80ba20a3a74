"""`unbroken run`'s monitor task outlives malformed heartbeats sent to its coordinator."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from tests.live_coordinator import connect
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.launch.run.launcher import Launcher, LaunchSettings


async def _scenario(run_dir: Path) -> tuple[int, bool]:
    launcher = Launcher(
        LaunchSettings(command=("true",), replicas=1, ranks_per_replica=2, run_dir=run_dir, warm_spare=False)
    )
    coordinator = Coordinator(CoordinatorSettings(total_replicas=1, state_dir=run_dir), launcher.secret)
    await coordinator.start()
    launcher.coordinator = coordinator
    monitor = asyncio.create_task(launcher._monitor())
    writers = []
    try:
        for rank in (0, 1):
            w = await connect(coordinator, launcher.secret)
            w.send({"op": "hello", "replica": 0, "rank": rank, "world_size": 2})
            writers.append(w)
        # Two malformed heartbeats: before, the coordinator kept them, and its status raised in
        # the monitor (comparing "slow" with [1]), which ended the task for good.
        writers[0].send({"op": "heartbeat", "step": 3, "compute_s": "slow"})
        writers[1].send({"op": "heartbeat", "step": 3, "compute_s": [1]})
        await asyncio.sleep(0.3)
        for w in writers:
            w.send({"op": "heartbeat", "step": 7, "compute_s": 0.25})
        for _ in range(100):  # the monitor still tracks progress
            if launcher.job_step == 7:
                break
            await asyncio.sleep(0.05)
        return launcher.job_step, monitor.done()
    finally:
        launcher._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(monitor, 2)
        for w in writers:
            w.close()
        await coordinator.stop()
        launcher.events.close()


def test_malformed_heartbeats_do_not_end_the_monitor(tmp_path: Path) -> None:
    step, ended = asyncio.run(_scenario(tmp_path / "run"))
    assert step == 7 and not ended


def test_a_verdict_after_sigterm_is_not_acted_on(tmp_path: Path) -> None:
    """Stopping replicas flush and go silent: a hang verdict then must not restart one."""
    import time

    from unbroken.launch.lifecycle import State
    from unbroken.observe import schema as ev
    from unbroken.observe.events import read_jsonl

    run_dir = tmp_path / "run"
    launcher = Launcher(LaunchSettings(command=("true",), replicas=2, run_dir=run_dir, warm_spare=False))
    try:
        launcher.lifecycle.state[1] = State.TRAINING
        launcher._terminated = time.monotonic()
        launcher._on_verdict(ev.Verdict(culprit={"replica": 1}, verdict_class="noncomm_hang", confidence=0.85))
    finally:
        launcher.events.close()
    kinds = [(e["kind"], e.get("reason")) for e in read_jsonl(run_dir / "events.jsonl")]
    assert ("verdict_ignored", "the job is ending (SIGTERM)") in kinds
    assert not any(k in ("verdict_acted", "restart_decision") for k, _ in kinds)
