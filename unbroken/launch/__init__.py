"""The supervisor: the core that starts, watches and ends a replica's worker processes
(``supervisor_core``, ``workers``, ``reaper``), the restart and isolation policy and a replica's
lifecycle, and its three rooms: ``run`` (``unbroken run``, one machine), ``node`` (``unbroken
agent``, one node of many) and ``recovery`` (verdicts, rollback, scheduled faults,
re-admission). Each room imports the core; ``run`` imports ``recovery``; the core imports no
room (docs/operations.md)."""
