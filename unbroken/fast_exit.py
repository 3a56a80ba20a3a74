"""A process that has imported torch exits in a fraction of a second instead of seconds.

At interpreter shutdown CPython tears modules down one by one and runs full garbage
collections over everything still alive: with torch, torch._dynamo and sympy loaded (any torch
optimizer imports them) that is about a million objects, and the exit takes seconds of CPU
(2.3 s measured on a busy 2-core machine; 0.5 s with this). A replica's exit sits on the
recovery path (a preempted replica flushing and leaving, a job ending, a supervisor restarting
a replica that exited), so it is worth making cheap.

At exit, one collection frees the real garbage (so cyclic objects with finalizers are still
finalized), then :func:`gc.freeze` moves the survivors out of the collector's sight: module
teardown then frees them by reference counting alone. That is not always enough: a file left
open in a global of the ``__main__`` script that also defines a class is never closed (the
class's methods and ``__main__``'s globals form a cycle the frozen collector leaves alone), so its
buffered writes are lost. Hence opt-in: unbroken's own processes (the CLI) and example scripts,
which close what they open, install it; ``unbroken.init()`` does not do it to your script.
"""

from __future__ import annotations

import atexit
import gc

_installed = False


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def install() -> None:
    """Registers the exit hook once per process (idempotent)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_collect_then_freeze)
