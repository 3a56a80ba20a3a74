"""How long the calling thread waited for a CPU: "this rank is slow" or "this machine is busy".

The flight recorder stamps every collective with it (:mod:`unbroken.comm.recorder`), and the
diagnosis master subtracts it from the time between collectives (:mod:`unbroken.diagnosis.master.master`).
"""

from __future__ import annotations

import os
import threading


class RunQueueWait:
    """The calling thread's cumulative time runnable but without a CPU (Linux schedstat), in ns.

    This is what tells "this rank is slow" from "this machine is busy": a rank whose compute is
    slow, or that sleeps, does not wait in the run queue; one whose CPU other processes hold
    does. Subtracting it from the time between two collectives leaves the rank's own compute
    time. Counts the training thread only (its intra-op helper threads are not read); 0 where
    the kernel does not say (then nothing is subtracted). One ``pread`` of about 2 us.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid: int | None = None

    def read(self) -> int:
        tid = threading.get_native_id()
        if tid != self._tid:
            self._tid = tid
            if self._fd is not None:
                os.close(self._fd)
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                self._fd = None
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0
