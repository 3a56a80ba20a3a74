"""Events, goodput accounting, ``unbroken status`` and the demo's report (docs/operations.md)."""
