"""The backend of each epoch's cross-replica group: pure choice, and the settings refused early."""

from __future__ import annotations

import pytest
import torch

from unbroken.comm.backend import check_backend, choose_backend


def test_auto_picks_nccl_only_when_every_member_holds_a_distinct_gpu() -> None:
    assert choose_backend("auto", "cuda", ["h1/GPU-a", "h1/GPU-b", "h2/GPU-a"]) == "nccl"
    assert choose_backend("auto", "cuda", ["h1/GPU-a", "h1/GPU-a"]) == "gloo"


def test_a_spare_on_a_shared_gpu_moves_only_its_own_epochs_to_gloo() -> None:
    without_spare = ["h1/GPU-0", "h1/GPU-1"]
    with_spare = [*without_spare, "h1/GPU-1"]
    assert choose_backend("auto", "cuda", without_spare) == "nccl"
    assert choose_backend("auto", "cuda", with_spare) == "gloo"


def test_cpu_tensors_always_go_over_gloo_and_explicit_settings_are_obeyed() -> None:
    assert choose_backend("auto", "cpu") == "gloo"
    assert choose_backend("gloo", "cuda", ["a", "b"]) == "gloo"
    assert choose_backend("nccl", "cuda", ["a", "a"]) == "nccl"  # the user asked: the job stops if it cannot work


def test_settings_that_can_never_work_are_refused_before_any_epoch() -> None:
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        check_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of auto, nccl, gloo"):
        check_backend("mpi", torch.device("cpu"))
    check_backend("auto", torch.device("cpu"))
    check_backend("gloo", torch.device("cuda"))
