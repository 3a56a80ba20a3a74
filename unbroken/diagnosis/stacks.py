"""A hung rank's stack, fetched by the process that started it.

The coordinator names a hung rank; it never signals a process or reads a file itself: a PID or a
path from the network could name anything (an unrelated process, ``/proc/self/environ``), and on
several nodes a PID means nothing on the coordinator's node. The owning supervisor (``unbroken
run``) or node agent signals the child it started, by the PID it got from the kernel, with the
stack signal of its own environment (the one its workers inherit), and reads the file at the
path it computes from its own run directory, where the worker's faulthandler writes
(:func:`stack_path`, used by both sides).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

STACK_WAIT_S = 0.3
MAX_STACK_CHARS = 8000


def stack_path(run_dir: str | os.PathLike[str], replica: int, rank: int) -> str:
    """Where the worker of ``replica``/``rank`` launched with ``run_dir`` dumps its stack."""
    return os.path.join(run_dir, "stacks", f"r{replica}-rank{rank}.txt")


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T for stopped...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


async def dump(pid: int, path: str, signum: int | None, wait_s: float = STACK_WAIT_S) -> dict[str, Any]:
    """Asks our own child ``pid`` for its stack; evidence for a hang verdict.

    A SIGSTOPped process cannot answer until SIGCONT: the evidence then says so (``process_state``
    ``T``) instead of carrying a stack.
    """
    state = process_state(pid)
    extra: dict[str, Any] = {"process_state": state}
    if state == "T":
        extra["stack"] = None
        extra["stack_note"] = "process is stopped (SIGSTOP): it cannot dump its stack until SIGCONT"
        return extra
    if state is None or signum is None:
        return extra
    before = _size(path)
    try:
        os.kill(pid, signum)
    except OSError as e:
        extra["stack_note"] = f"could not signal pid {pid}: {e}"
        return extra
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _size(path) <= before:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.02)  # let the dump finish
    extra["stack"] = _read_from(path, before)
    return extra


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str | None:
    try:
        with open(path) as f:
            f.seek(offset)
            return f.read()[-MAX_STACK_CHARS:] or None
    except OSError:
        return None
