"""Example workloads shipped with the package, so that ``unbroken demo`` and the benchmarks run
from an installed wheel, not only from a checkout."""
