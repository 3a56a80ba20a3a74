"""The DDP wrapper's pure parts: how parameters fall into buckets, and the exchange's busy time."""

from __future__ import annotations

import torch

from unbroken.comm.cross_replica import PendingSum
from unbroken.train.ddp import DistributedDataParallel, _buckets
from unbroken.train.step.overlap import busy_seconds


def test_buckets_follow_reverse_parameter_order_up_to_the_cap() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 50, 50, 300, 10)]
    # 100 floats = 400 bytes per bucket: the last parameter first, as backward produces them.
    assert _buckets(params, 400) == [[4], [3], [2, 1], [0]]
    assert _buckets(params, 10**6) == [[4, 3, 2, 1, 0]]
    assert sorted(i for b in _buckets(params, 1) for i in b) == list(range(5))  # each alone, none lost


def test_the_first_bucket_is_small_so_the_exchange_starts_early() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 50, 50, 300, 10)]
    # A first bucket of 40 floats holds only the last parameter; the rest fill 1,600-byte buckets.
    assert _buckets(params, 1600, first_cap_bytes=160) == [[4], [3, 2, 1], [0]]
    assert _buckets(params, 1600, first_cap_bytes=1600) == _buckets(params, 1600)


def test_busy_seconds_counts_overlapping_sums_once() -> None:
    def sum_(started: float, finished: float | None) -> PendingSum:
        p = PendingSum(0, None)
        p.started, p.finished = started, finished
        return p

    # Two sums queued behind each other, then one after a gap; an unfinished one counts nothing.
    assert busy_seconds([sum_(0.0, 1.0), sum_(0.5, 1.5), sum_(3.0, 3.25), sum_(4.0, None)]) == 1.75


class _NoExchange:
    """The one call the wrapper's constructor makes on its manager."""

    def expect_gradients(self, numel: int) -> None:
        pass


def test_the_wrapper_is_a_module_whose_state_dict_buffers_and_to_work() -> None:
    """Its bucket storage must not shadow ``nn.Module._buffers`` (state_dict and .to() read it)."""
    inner = torch.nn.BatchNorm1d(3)
    model = DistributedDataParallel(inner, _NoExchange())  # type: ignore[arg-type]
    assert list(model.state_dict()) == [f"module.{k}" for k in inner.state_dict()]
    assert len(list(model.buffers())) == len(list(inner.buffers()))
    assert model.to(torch.float64).module.weight.dtype == torch.float64
