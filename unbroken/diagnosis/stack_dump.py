"""The worker's side of a hang's evidence: every thread's stack, written on a signal.

A rank installs :class:`StackDump` when it joins (the Manager does, at the path
:func:`unbroken.diagnosis.stacks.stack_path` gives); the process that started it sends the
signal and reads the file (:mod:`unbroken.diagnosis.stacks`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path
from typing import IO

STACK_SIGNAL = signal.SIGUSR1


class StackDump:
    """Writes every thread's Python stack to ``path`` when the process gets ``signum`` (hang verdicts).

    faulthandler writes from the C signal handler, so a rank stuck in a blocking C call (a
    sleep, a collective wait) still answers. A SIGSTOPped process cannot: the signal stays
    pending until SIGCONT. A handler the program installed before (Slurm's and Lightning's
    SIGUSR1 handlers) still runs after the dump: taking the signal over would break them. With
    no earlier handler nothing is chained, since the default action of SIGUSR1 ends the process.
    The handler stays for the life of the process: the diagnosis may still ask a finishing
    process for its stack, and with SIGUSR1's default action back that would kill it.
    """

    def __init__(self, path: str | os.PathLike[str], signum: int = STACK_SIGNAL) -> None:
        self.path = Path(path)
        self.signum = signum
        previous = signal.getsignal(signum)
        # None: a handler installed outside Python, which must keep working too.
        chain = previous is None or callable(previous)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file: IO[str] = open(self.path, "w")  # noqa: SIM115 - must stay open for the signal handler
        faulthandler.register(signum, file=self.file, all_threads=True, chain=chain)


def install_stack_dump(path: str | os.PathLike[str], signum: int = STACK_SIGNAL) -> StackDump:
    """Makes ``signum`` write every thread's Python stack to ``path`` (see :class:`StackDump`)."""
    return StackDump(path, signum)
