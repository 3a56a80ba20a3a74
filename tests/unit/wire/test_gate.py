"""The gate's process-wide part: a listening process can hold a flood's descriptors."""

from __future__ import annotations

import resource
import subprocess
import sys


def test_a_listening_process_raises_its_descriptor_limit_within_the_hard_one() -> None:
    """At the common soft limit of 1,024 a few hundred strangers' connections per listener
    would leave the process no descriptor for anything else."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    code = "from unbroken.wire.gate import raise_descriptor_limit as r; print(r(4096))"
    done = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=low, capture_output=True, text=True, timeout=60, check=True
    )
    assert int(done.stdout) == expected
