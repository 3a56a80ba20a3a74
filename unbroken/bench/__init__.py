"""Benchmarks behind ``unbroken bench ...``; each prints one JSON object with ``--json``."""
