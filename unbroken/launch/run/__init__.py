"""``unbroken run``: a whole job on one machine, supervised by one process (the fault-tolerant
``torchrun``): its settings and command line, the launcher, its dashboard, the warm spare, the
demo, and ``--torchft-compat``."""
