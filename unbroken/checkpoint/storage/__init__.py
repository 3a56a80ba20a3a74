"""A checkpoint on disk: its layout and manifest, checksums, direct I/O, the atomic commit, the
job's history and retention, reading back re-cut to any world size, and DCP's storage. Only the
reading back (``restore``) and DCP's storage import torch: the persist process writes with the
rest, without it."""
