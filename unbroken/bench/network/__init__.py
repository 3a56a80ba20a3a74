"""Benchmarks of the network and its diagnosis: faults named right (``diagnosis`` and its rates),
ICCL's ring against Gloo, the traffic planner against ECMP, and the cluster box's real network
faults (``cluster``)."""
