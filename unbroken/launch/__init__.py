"""The supervisor: ``unbroken run``, ``unbroken agent``, restart and isolation policy, fault
injection, worker processes, the demo (docs/operations.md)."""
