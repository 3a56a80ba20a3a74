"""Fault injection, in one place: real faults on a real job, for tests, benchmarks and the demo.

- :mod:`~unbroken.faults.schedule`: what fault, when (a step or a time), on which replica, rank
  or link; parsed from ``--fault`` flags and schedule files (pure, tested alone).
- :mod:`~unbroken.faults.supervisor`: the faults that act on processes, fired by the supervisor
  (``kill -9``, ``SIGSTOP``/``SIGCONT``, a file-size limit on a checkpoint writer).
- :mod:`~unbroken.faults.worker_chaos`: the faults a rank applies to its own training (a slow rank, a
  slow link, a NaN loss), as the Manager's :class:`~unbroken.train.hooks.FaultHook`.
- :mod:`~unbroken.faults.link`: link faults in the ring's transport (``UNBROKEN_LINK_FAULT``).

Layering: this package imports :mod:`unbroken.config` only; ``launch`` imports it, and
``unbroken.init()`` (:mod:`unbroken.entry`) installs the worker's hooks. ``train`` and ``comm``
never import it: the Manager and the flight recorder take the hooks they are given.
See docs/architecture.md.
"""
