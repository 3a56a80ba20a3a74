"""Re-admitting an isolated node of ``unbroken run`` once it passes a self-check.

A node isolated by blame or by a verdict (:mod:`unbroken.launch.policy`) waits out its
cool-down, then runs the self-check of :mod:`unbroken.launch.recovery.selfcheck` on its slot: two
processes train a few steps against each other, the checked one with the slot's worker faults
still in effect (a slot that is still slow fails). A pass returns the node's slots to the pool
and the supervisor restarts the replicas that were parked for want of a slot; a failure starts
another cool-down.

Kept out of the supervisor's loop: it starts and ends processes of its own, and what it needs of
the supervisor (its placement, the faults still in effect, what to do on a pass) comes in
through the constructor.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from unbroken import config as env
from unbroken.faults.schedule import Fault
from unbroken.faults.worker_chaos import chaos_env
from unbroken.launch import reaper, workers
from unbroken.launch.policy import Placement
from unbroken.observe.events import EventLog

SELF_CHECK_TIMEOUT_S = 60.0  # both processes must be done by then, or the check fails


class Readmission:
    """Runs the self-checks of the isolated nodes whose cool-down is over, one at a time each.

    Args:
        placement: the supervisor's placement (which nodes are isolated, their home replicas).
        events: the supervisor's event log (``self_check``, ``node_readmitted``).
        secret_file: the job's secret, for the self-check's authenticated rendezvous.
        faults_on: the worker faults still in effect on a replica's home slot at a time.
        guardian: the supervisor's guardian, once it has one (it ends the check's processes
            if the supervisor dies).
        readmitted: what the supervisor does once ``node`` is back (restart parked replicas).
        run_task: runs a coroutine as one of the supervisor's tasks (cancelled at its end).
    """

    def __init__(
        self,
        placement: Placement,
        events: EventLog,
        secret_file: Path,
        faults_on: Callable[[int, float], list[Fault]],
        guardian: Callable[[], reaper.Guardian | None],
        readmitted: Callable[[str], Awaitable[None]],
        run_task: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.placement = placement
        self.events = events
        self.secret_file = secret_file
        self.faults_on = faults_on
        self.guardian = guardian
        self.readmitted = readmitted
        self.run_task = run_task

    def check_due(self, now: float) -> None:
        """Starts the self-check of every isolated node whose cool-down is over at ``now``."""
        for node in self.placement.due_for_check(now):
            self.placement.isolated[node] = float("inf")  # one check at a time
            self.run_task(self.self_check(node))

    async def self_check(self, node: str) -> None:
        """Trains a few steps on ``node``'s slot against a peer; a pass re-admits the node."""
        home = next((r for r, s in self.placement.home.items() if s.node == node), None)
        now = time.time()
        still = self.faults_on(home, now) if home is not None else []
        port = workers.free_port()
        base = [sys.executable, "-m", "unbroken.launch.recovery.selfcheck", "--port", str(port)]
        extra = {**workers.package_path(), "OMP_NUM_THREADS": "1", env.ENV_SECRET_FILE: str(self.secret_file)}
        procs = []
        for role, fenv in (("checked", chaos_env(still, now)), ("reference", {})):
            procs.append(
                await asyncio.create_subprocess_exec(
                    *base,
                    "--role",
                    role,
                    env={**os.environ, **extra, **fenv},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=workers.die_with_parent(),
                )
            )
            guardian = self.guardian()
            if guardian is not None:
                guardian.add(procs[-1].pid)
        try:
            waits = [asyncio.ensure_future(p.wait()) for p in procs]
            done, _ = await asyncio.wait(waits, timeout=SELF_CHECK_TIMEOUT_S)
            passed = len(done) == len(waits) and all(w.result() == 0 for w in waits)
        finally:
            await workers.kill_groups(procs, self.guardian())
        self.placement.readmit(node, passed, time.time())
        self.events.emit("self_check", node=node, passed=passed)
        if passed:
            self.events.emit("node_readmitted", node=node)
            await self.readmitted(node)
