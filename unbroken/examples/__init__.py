"""Example models and training loops that ship with unbroken (importable, so the benchmarks and tests can run them)."""
