"""The data plane across replicas: the per-epoch group with bounded waits and abort, the learned
deadline, the ring, catch-up state transfer, the flight recorder (docs/architecture.md)."""
