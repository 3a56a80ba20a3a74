"""torchft's own integration tests, from the torchft-nightly 2026.10.26 wheel, on unbroken.

No torchft file is edited: the wheel is unpacked by ``make torchft-upstream`` and only the
import is redirected, by the shim of ``unbroken run --torchft-compat`` with the wheel's
directory behind it (:func:`unbroken.launch.run.torchft_compat.write_shim`): ``torchft.manager``,
``torchft.local_sgd``, ``torchft.process_group``... are unbroken's facade, the test modules and
``torchft._test`` are the wheel's. The CPU stand-ins, all in that one shim:

- ``torchft._torchft`` (the Rust extension): only ``LighthouseServer`` is used by these tests;
  it is :class:`unbroken.torchft.lighthouse.LighthouseServer`, an unbroken coordinator on a
  thread of the test process.

The tests run replicas as threads of one process (several Managers in one process). What
cannot pass, and why, is in ``CANNOT_PASS``; a test that starts passing fails this one, so the
lists stay true.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.launch.run.torchft_compat import write_shim

pytestmark = [pytest.mark.integration, pytest.mark.scenario]

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / ".cache" / "upstream" / "torchft"  # make torchft-upstream unpacks the wheel here

THREADS_AS_RANKS = "ranks of one replica run as threads share its default process group: unbroken refuses them"
CANNOT_PASS = {
    "manager_integ_test": {
        "test_ddp_recovery_multi_rank": THREADS_AS_RANKS,
        "test_quorum_timeout": THREADS_AS_RANKS
        + " (world_size=2 in one thread); and it expects the text of torchft's gRPC timeout error",
    },
    "local_sgd_integ_test": {},
}
# Skipped by the tests themselves on this machine: torchcomms not installed, no GPU, native
# process groups with enable_reconfigure (torch's own reconfigurable Gloo, not a torchft group).
SKIPPED = {
    "manager_integ_test": {
        "test_ddp_healthy_torchcomms",
        "test_ddp_recovery_torchcomms",
        "test_ddp_recovery_2_native_async_quorum",
        "test_ddp_recovery_3_native_sync_quorum",
        "test_manager_allreduce_0",
    },
    "local_sgd_integ_test": set(),
}


def _outcomes(text: str) -> dict[str, str]:
    """Each test's outcome in pytest's verbose output (``...::Class::test_x PASSED``)."""
    return dict(re.findall(r"::(\w+) (PASSED|FAILED|ERROR|SKIPPED)", text))


@pytest.mark.parametrize("module", sorted(CANNOT_PASS))
def test_torchft_integration_tests_on_the_facade(module: str, tmp_path: Path) -> None:
    if not (UPSTREAM / f"{module}.py").exists():
        pytest.skip(f"torchft's wheel is not unpacked at {UPSTREAM}: run `make torchft-upstream`")
    shim = write_shim(tmp_path, upstream=UPSTREAM)
    path = [str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "OMP_NUM_THREADS": "1"}
    args = ["-p", "no:cacheprovider", "-v", "--timeout", "120", "-o", "addopts=", "--pyargs"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, f"torchft.{module}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    got = _outcomes(out.stdout)
    (tmp_path / "pytest.log").write_text(out.stdout + out.stderr)
    assert got, out.stdout[-3000:] + out.stderr[-3000:]
    not_passed = {t: o for t, o in got.items() if o not in ("PASSED", "SKIPPED")}
    assert not_passed.keys() == CANNOT_PASS[module].keys(), (not_passed, out.stdout[-5000:])
    skipped = {t for t, o in got.items() if o == "SKIPPED"}
    assert skipped <= SKIPPED[module], skipped
    passed = sum(o == "PASSED" for o in got.values())
    print(f"{module}: {passed} passed of {len(got)} ({len(skipped)} skipped by the test itself)")
