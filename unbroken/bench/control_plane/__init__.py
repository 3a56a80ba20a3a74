"""Benchmarks of the control plane: the coordinator at scale (``coordinator_load`` and its
simulated groups and nodes), groups' rendezvous, epochs' release, the lease on real filesystems
(and the FUSE that lies), a stranger's flood, and what authentication costs."""
