"""The supervisor's side of fault injection: the means of the faults that act on processes.

The schedule's (:mod:`unbroken.faults.schedule`) worker-side faults travel in the workers'
environment (:mod:`unbroken.faults.worker_chaos`); the ones here need the supervisor, which holds the
process ids (``unbroken run`` fires them when they are due): ``kill -9``, ``SIGSTOP``/``SIGCONT``, stopping the
coordinator, and a file-size limit on a replica's checkpoint writer (``prlimit``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from pathlib import Path

PERSIST_MODULE = "unbroken.checkpoint.persist"


def send(pid: int, sig: signal.Signals) -> bool:
    """Signals one process; False if it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def session_processes(session_id: int) -> list[int]:
    """Every process in ``session_id`` (a worker runs in its own session with its children)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session_id:  # fields after the name: state ppid pgrp session
                out.append(int(entry.name))
    return out


def checkpoint_writers(session_id: int) -> list[int]:
    """The checkpoint persist processes a worker spawned."""
    out = []
    for pid in session_processes(session_id):
        with contextlib.suppress(OSError):
            if PERSIST_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def limit_file_size(pids: list[int], limit_bytes: int | None) -> list[int]:
    """Sets RLIMIT_FSIZE of ``pids`` (None lifts it); writes past it fail with EFBIG."""
    value = resource.RLIM_INFINITY if limit_bytes is None else limit_bytes
    done = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (value, value))
            done.append(pid)
    return done
