"""The pure helpers of the torchft facade: the tensors of a state, and init_sync's source."""

from __future__ import annotations

import torch

from unbroken.torchft.init_sync import broadcast_by_sum, local_tensors, sync_source


def test_local_tensors_walks_nested_state_in_order_and_skips_the_rest() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    state = {"model": {"w": a, "b": b}, "optim": {"state": {0: {"step": 3, "m": c}}, "groups": [{"lr": 0.1}]}}
    got = list(local_tensors(state))
    assert [t.numel() for t in got] == [1, 2, 3]
    assert got[0] is a and got[2] is c  # the tensors themselves, so a copy_ into them updates the state


def test_sync_source_is_the_lowest_member_only_when_everyone_is_at_the_same_step() -> None:
    assert sync_source((2, 5, 7), ()) == 2
    assert sync_source((3,), ()) is None  # alone: nothing to agree with
    assert sync_source((0, 1), (1,)) is None  # one catches up: its donor's state comes anyway


def test_a_sum_of_the_source_and_zeros_is_the_source_bit_for_bit() -> None:
    src = torch.tensor([1e-38, -3.5, float("inf"), 7.0], dtype=torch.float32)
    parts = [broadcast_by_sum(src, True), broadcast_by_sum(src.neg(), False), broadcast_by_sum(src, False)]
    total = parts[0] + parts[1] + parts[2]
    assert torch.equal(total, src)
    ints = torch.tensor([3, -9], dtype=torch.int64)
    assert torch.equal(broadcast_by_sum(ints, True) + broadcast_by_sum(ints, False), ints)


def test_as_like_makes_received_shards_dtensors_where_the_receiver_holds_dtensors(tmp_path: object) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from unbroken.torchft.init_sync import as_like

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        own = {"w": DTensor.from_local(torch.zeros(2), mesh, [Replicate()]), "n": torch.zeros(1), "k": 3}
        got = as_like({"w": torch.ones(2), "n": torch.full((1,), 5.0), "k": 4}, own)
        assert isinstance(got["w"], DTensor) and torch.equal(got["w"].to_local(), torch.ones(2))
        assert not isinstance(got["n"], DTensor) and got["k"] == 4
    finally:
        dist.destroy_process_group()
