"""Fingerprints are exact (same bytes, same value), see every single flipped bit, and see order."""

from __future__ import annotations

import pytest
import torch

from unbroken.comm.fingerprint import BLOCK, fingerprint, fold, state_prints


def fp(t: torch.Tensor) -> int:
    return fold([fingerprint(t)])


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK + 17])
def test_every_single_bit_flip_changes_the_fingerprint(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g)
    before = fp(t)
    words = t.view(torch.int32)
    for index in {0, n // 2, n - 1}:
        for bit in (0, 7, 22, 23, 30, 31):
            flipped = t.clone()
            flipped.view(torch.int32)[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            assert fp(flipped) != before, (index, bit)
    assert fp(words.view(torch.float32).clone()) == before  # same bytes, same value


def test_swapped_elements_change_it_and_addition_order_does_not() -> None:
    t = torch.arange(1.0, 2 * BLOCK + 3)
    swapped = t.clone()
    swapped[[3, BLOCK + 9]] = swapped[[BLOCK + 9, 3]]
    assert fp(swapped) != fp(t)
    blocks = t[: 2 * BLOCK].view(2, BLOCK)
    assert fp(blocks.flip(0).reshape(-1)) != fp(t[: 2 * BLOCK])  # two blocks swapped
    # Integer sums do not depend on the order a kernel adds in: as many threads as you like.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp(t)
        torch.set_num_threads(2)
        assert fp(t) == one
    finally:
        torch.set_num_threads(before)


def test_every_dtype_and_odd_sizes_and_slices() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool):
        t = (torch.randn(1001) * 5).to(dtype)
        assert fp(t) == fp(t.clone())
    base = torch.randn(100)
    assert fp(base[1:98]) == fp(base[1:98].clone())  # a slice at an odd offset falls back to bytes
    assert fp(torch.zeros(0)) == fp(torch.zeros(0))
    m = torch.randn(10, 10)
    assert fp(m.t()) == fp(m.t().contiguous())  # by the bytes in logical order


def test_fold_is_order_sensitive_and_never_zero() -> None:
    a, b = fingerprint(torch.ones(3)), fingerprint(torch.zeros(3))
    assert fold([a, b]) != fold([b, a])
    assert fold([]) == 0 and fold([b]) != 0


def test_state_prints_walk_nested_state_in_key_order() -> None:
    state = {"model": {"w": torch.ones(4), "b": torch.zeros(2)}, "optim": {"state": {0: {"exp_avg": torch.ones(4)}}}}
    same = {"optim": {"state": {0: {"exp_avg": torch.ones(4)}}}, "model": {"b": torch.zeros(2), "w": torch.ones(4)}}
    assert fold(state_prints(state)) == fold(state_prints(same))
    state["optim"]["state"][0]["exp_avg"][2] = 1.0000001
    assert fold(state_prints(state)) != fold(state_prints(same))


def test_state_prints_see_a_flip_in_a_large_and_in_a_small_tensor() -> None:
    from unbroken.comm.fingerprint import SMALL

    state = {
        "big": torch.randn(SMALL + 3),
        "bias": torch.randn(5),
        "step": torch.tensor(7.0),
        "flag": torch.tensor(True),
    }
    before = fold(state_prints(state))
    for key, index in (("big", SMALL + 1), ("bias", 4)):
        state[key].view(torch.int32)[index] ^= 1
        assert fold(state_prints(state)) != before, key
        state[key].view(torch.int32)[index] ^= 1
    assert fold(state_prints(state)) == before
    assert len(state_prints(state)) == 2  # the large tensor alone, the small ones together
