"""When the coordinator ends a job instead of looping: pure logic, time passed in."""

from __future__ import annotations

import math

import pytest

from unbroken.control.quorum.failure import classify
from unbroken.control.quorum.job_health import EXIT_CONFIG, EXIT_NO_PROGRESS, JobHealth

NCCL_DUPLICATE = (
    "NCCL error in: ProcessGroupNCCL.cpp:1234, invalid usage (run with NCCL_DEBUG=WARN for details), "
    "NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
)
NO_INTERFACE = (
    "epoch 3: building the group failed: [enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. "
    "Unable to find address for: nope0"
)
TIMEOUT = "exchange in epoch 4 passed its 1.20s deadline"
RESET = "exchange failed in epoch 4: Connection reset by peer"


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (NCCL_DUPLICATE, "nccl_invalid_usage"),
        (NO_INTERFACE, "no_such_interface"),
        ("building the group failed: Cannot resolve 10.9.9.9 to a (local) address", "no_such_address"),
        ("module 'torch.distributed' has no attribute 'ProcessGroupNCCL'", "backend_missing"),
    ],
)
def test_errors_no_retry_can_mend_are_fatal_with_a_hint(error: str, cause: str) -> None:
    kind = classify(error)
    assert kind.fatal and kind.cause == cause and kind.hint


@pytest.mark.parametrize(
    "error",
    [TIMEOUT, RESET, "epoch 5 was aborted by the coordinator", "Connection refused", "CUDA out of memory"],
)
def test_connectivity_errors_are_faults(error: str) -> None:
    assert not classify(error).fatal


def test_the_duplicate_gpu_hint_names_the_flag_that_fixes_it() -> None:
    assert "--cross-replica-backend gloo" in classify(NCCL_DUPLICATE).hint


def fail_epoch(h: JobHealth, epoch: int, members: list[int], error: str | None) -> object:
    stop = None
    for r in members:
        stop = h.failed(epoch, members, r, error) or stop
    return stop


def test_three_fatal_epochs_in_a_row_stop_the_job_with_the_error_members_and_hint() -> None:
    h = JobHealth(fatal_epochs=3)
    h.asked(0.0)
    assert fail_epoch(h, 1, [0, 1, 2], NCCL_DUPLICATE) is None
    assert fail_epoch(h, 2, [0, 1, 2], NCCL_DUPLICATE) is None
    stop = fail_epoch(h, 3, [0, 1], NCCL_DUPLICATE)
    assert stop is not None
    assert stop.exit_code == EXIT_CONFIG and stop.cause == "configuration"  # type: ignore[attr-defined]
    assert stop.members == (0, 1) and "Duplicate GPU" in stop.error  # type: ignore[attr-defined]
    assert "--cross-replica-backend gloo" in stop.hint and "1, 2, 3" in stop.reason  # type: ignore[attr-defined]


def test_an_epoch_counts_only_once_every_member_reported_a_fatal_error() -> None:
    h = JobHealth(fatal_epochs=1)
    assert h.failed(1, [0, 1], 0, NCCL_DUPLICATE) is None
    assert h.failed(1, [0, 1], 0, NCCL_DUPLICATE) is None  # the same member twice is one report
    assert h.failed(1, [0, 1], 5, NCCL_DUPLICATE) is None  # not a member
    assert h.failed(1, [0, 1], 1, NCCL_DUPLICATE) is not None


def test_a_member_that_failed_by_a_fault_makes_it_no_fatal_epoch() -> None:
    h = JobHealth(fatal_epochs=2)
    assert h.failed(1, [0, 1], 0, NO_INTERFACE) is None
    assert h.failed(1, [0, 1], 1, TIMEOUT) is None
    assert fail_epoch(h, 2, [0, 1], NO_INTERFACE) is None  # the first fatal epoch of a new row
    assert fail_epoch(h, 3, [0, 1], NO_INTERFACE) is not None


def test_a_fault_or_a_commit_between_fatal_epochs_breaks_the_row() -> None:
    h = JobHealth(fatal_epochs=2)
    assert fail_epoch(h, 1, [0, 1], NO_INTERFACE) is None
    assert fail_epoch(h, 2, [0, 1], RESET) is None
    assert fail_epoch(h, 3, [0, 1], NO_INTERFACE) is None
    h.progressed(10.0)
    assert fail_epoch(h, 4, [0, 1], NO_INTERFACE) is None
    assert fail_epoch(h, 5, [0, 1], NO_INTERFACE) is not None


def test_no_progress_for_the_timeout_stops_the_job_with_the_last_failures() -> None:
    h = JobHealth(no_progress_s=60.0)
    assert h.check(1000.0) is None  # nobody asked yet: the clock has not started
    h.asked(100.0)
    h.failed(7, [0, 1], 0, RESET)
    assert h.check(160.0, [0, 1]) is None
    stop = h.check(160.5, [0, 1])
    assert stop is not None and stop.exit_code == EXIT_NO_PROGRESS and stop.cause == "no_progress"
    assert "no step committed for 60s" in stop.reason and "Connection reset" in stop.reason
    h.progressed(160.5)
    assert h.check(200.0) is None


def test_a_zero_timeout_never_stops() -> None:
    h = JobHealth(no_progress_s=0.0)
    h.asked(0.0)
    assert h.check(1e9) is None


@pytest.mark.parametrize(("epochs", "timeout"), [(0, 60.0), (4, 60.0), (3, -1.0), (3, math.nan)])
def test_impossible_settings_are_refused(epochs: int, timeout: float) -> None:
    with pytest.raises(ValueError):
        JobHealth(fatal_epochs=epochs, no_progress_s=timeout)
