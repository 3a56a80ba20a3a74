"""The supervisor's side of the warm spare: one worker process kept ready for the next restart.

The process itself is :mod:`unbroken.launch.run.warm` (torch already imported, waiting on stdin);
this module starts it, hands it a restarted replica's environment, log and arguments, and ends
it with the job. Apart from the supervisor because it is a resource of its own, with one rule
about when it can be used (:meth:`WarmSpare.usable`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

from unbroken import config as env
from unbroken.launch import reaper, workers


class WarmSpare:
    """At most one warm worker, for ``python script.py`` or ``python -m module`` commands.

    Args:
        command: the worker command line.
        enabled: ``--warm-spare``.
        ranks_per_replica: a warm worker runs only one-rank replicas.
        threads: torch threads per worker.
        guardian: the supervisor's guardian, once it has one (it ends the warm worker if the
            supervisor dies).
    """

    def __init__(
        self,
        command: tuple[str, ...],
        enabled: bool,
        ranks_per_replica: int,
        threads: int,
        guardian: Callable[[], reaper.Guardian | None],
    ) -> None:
        self.command = command
        self.enabled = enabled
        self.ranks_per_replica = ranks_per_replica
        self.threads = threads
        self.guardian = guardian
        self.proc: asyncio.subprocess.Process | None = None

    def usable(self) -> bool:
        """``python script.py`` or ``python -m module``, one rank per replica: a warm worker can run it."""
        c = self.command
        runnable = len(c) >= 2 and (c[1].endswith(".py") or (c[1] == "-m" and len(c) >= 3))
        return self.enabled and self.ranks_per_replica == 1 and runnable and os.path.basename(c[0]).startswith("python")

    async def start(self) -> None:
        """Starts the warm worker (the next :meth:`take` hands it over)."""
        env_ = {
            **os.environ,
            **workers.package_path(),
            "PYTHONUNBUFFERED": "1",
            env.ENV_OMP_NUM_THREADS: env.omp_num_threads(self.threads),
        }
        guardian = self.guardian()
        self.proc = await asyncio.create_subprocess_exec(
            self.command[0],
            "-m",
            "unbroken.launch.run.warm",
            env=env_,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=workers.die_with_parent(guardian.fileno() if guardian is not None else None),
        )
        if guardian is not None:
            guardian.add(self.proc.pid)

    async def take(self, environ: dict[str, str], log: Path) -> asyncio.subprocess.Process | None:
        """The warm worker, now running the command with ``environ`` and logging to ``log``;
        None when there is none alive (start the worker cold)."""
        warm, self.proc = self.proc, None
        if warm is None or warm.returncode is not None or warm.stdin is None:
            return None
        order = {"env": environ, "argv": list(self.command[1:]), "log": str(log)}
        warm.stdin.write((json.dumps(order) + "\n").encode())
        await warm.stdin.drain()
        warm.stdin.close()
        return warm

    async def close(self) -> None:
        """Ends the warm worker, if there is one."""
        if self.proc is not None:
            await workers.kill_groups([self.proc], self.guardian())
