"""The data plane across replicas: the per-epoch group with bounded waits and abort, the learned
deadline, the ring, live catch-up from a donor (catchup.py), the flight recorder
(docs/architecture.md)."""
