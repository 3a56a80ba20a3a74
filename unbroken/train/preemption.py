"""Preemption: on SIGTERM a worker finishes its step, flushes its state to disk and exits.

Slurm preemption and ``scancel``, Kubernetes eviction and ``unbroken run`` itself (which
forwards the signal, see ``--term-grace-s``) all send SIGTERM and, some seconds later, SIGKILL.
The handler only raises a flag; the training loop acts on it at the next step boundary, in
:func:`unbroken.train.checkpointing.save_if_due`: every replica (not only the one that writes
the periodic checkpoints, which may be the one that cannot finish its step because its peers
already left) saves the state of the step it just committed, waits for the save to be durable
(:meth:`~unbroken.checkpoint.Checkpointer.close`) and ends the process with
:data:`EXIT_PREEMPTED` (:data:`EXIT_FLUSH_FAILED` when the save did not reach the disk).
Relaunching the same command resumes from that checkpoint.

The ranks of one replica must stop at the same step, or the one that goes on waits forever in
the replica's collectives for the one that left. A signal reaches them at slightly different
times, but the replica's per-step vote keeps them within one step of each other, so the first
rank that sees the flag proposes "the next step boundary" in the replica group's store and every
rank stops at the proposal it reads back (compare-and-set: the first proposal wins). A replica of
one rank stops at once.

The process ends with ``os._exit``: after the flush, waiting for the interpreter to tear down
communication threads and process groups could outlast the grace period; code after the
training loop therefore does not run on preemption.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with the state flushed; run again to resume
EXIT_FLUSH_FAILED = 74  # EX_IOERR: stopped on request, but this step did not reach the disk
_STORE_KEY = "unbroken/preempt_step"

_requested = False
_stop_at: int | None = None
_previous: Any = None
_installed = False


def install() -> bool:
    """Installs the SIGTERM handler (once, from the main thread); returns whether it is in place.

    An earlier Python handler keeps working: it is called after the flag is raised. The default
    action (terminate at once) is what this replaces.
    """
    global _installed, _previous
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption: not on the main thread; SIGTERM will not flush a checkpoint")
        return False
    _previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True
    return True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    if callable(_previous):
        _previous(signum, frame)


def requested() -> bool:
    """Whether SIGTERM arrived."""
    return _requested


def should_stop(step: int, world_size: int) -> bool:
    """Whether the loop must stop at this step boundary (``step`` committed steps so far)."""
    global _stop_at
    if not _requested:
        return False
    if _stop_at is None:
        _stop_at = _agree(step + 1, world_size) if world_size > 1 else step
    return step >= _stop_at


def _agree(proposal: int, world_size: int) -> int:
    """The stop step of this replica's ranks: the first proposal written to its store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return proposal - 1
    store = dist.distributed_c10d._get_default_store()
    return int(store.compare_set(_STORE_KEY, "", str(proposal)))


def exit_now(code: int = EXIT_PREEMPTED) -> None:
    """Ends the process at once, its output flushed (see the module doc for why not SystemExit)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _reset_for_tests() -> None:
    global _requested, _stop_at
    _requested, _stop_at = False, None
