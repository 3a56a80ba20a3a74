"""The supervisor: ``unbroken run``, ``unbroken agent``, restart and isolation policy, firing
the faults of a schedule (the faults themselves: unbroken.faults), worker processes, the demo
(docs/operations.md)."""
