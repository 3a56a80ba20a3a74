"""Checkpoint manifests, layout, flattening, resharding plans and retention: pure logic."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load

from unbroken.checkpoint.snapshot import Shard, TensorRef, flatten, unflatten
from unbroken.checkpoint.storage import reshard, retention
from unbroken.checkpoint.storage.manifest import ShardManifest, TensorSpec, layout, safetensors_header


def spec(name: str, dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, dtype, shape, shape, (0,) * len(shape))


def test_layout_is_contiguous_and_aligned() -> None:
    entries = layout([spec("a", "uint8", (3,)), spec("b", "float64", (2,)), spec("c", "float16", (5,))])
    assert [e.name for e in entries] == ["b", "c", "a"]
    offset = 0
    for e in entries:
        assert e.begin == offset and e.begin % {"float64": 8, "float16": 2, "uint8": 1}[e.dtype] == 0
        offset = e.end
    assert offset == 16 + 10 + 3


@pytest.mark.parametrize(
    "bad, message",
    [
        ([spec("a", "float32", (1,)), spec("a", "int8", (1,))], "unique"),
        ([spec("a", "complex64", (1,))], "cannot be checkpointed"),
        ([TensorSpec("a", "float32", (4,), (6,), (3,))], "outside global shape"),
    ],
)
def test_layout_rejects_bad_specs(bad: list[TensorSpec], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout(bad)


def test_header_plus_buffer_is_a_safetensors_file() -> None:
    tensors = {"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.randn(2).bfloat16()}
    entries = layout([spec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()])
    data = io.BytesIO()
    for e in entries:
        data.write(tensors[e.name].reshape(-1).view(torch.uint8).numpy().tobytes())
    loaded = load(safetensors_header(entries) + data.getvalue())
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)


def test_manifest_round_trip_and_damage() -> None:
    m = ShardManifest(7, 0, 2, 1, 4, layout([spec("x", "float32", (4, 2))]))
    again = ShardManifest.from_json(m.to_json())
    assert again == m
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardManifest.from_json(m.to_json()[:-5])
    broken = m.to_json().replace('"begin": 0', '"begin": 4').replace('"end": 32', '"end": 36')
    with pytest.raises(ValueError, match="hole or overlap"):
        ShardManifest.from_json(broken)


def test_flatten_round_trip_keeps_structure_and_objects() -> None:
    state = {
        "model": {"w": torch.ones(2)},
        "opt": [torch.zeros(1), {"lr": 0.1}],
        "shard": Shard(torch.ones(2, 2), (4, 2), (2, 0)),
        "pos": (3, "x"),
    }
    tensors, skeleton = flatten(state)
    assert set(tensors) == {"model/w", "opt/0", "shard"}
    assert tensors["shard"][1].global_offset == (2, 0)
    assert skeleton["model"]["w"] == TensorRef("model/w", False)
    back = unflatten(skeleton, {k: t for k, (t, _) in tensors.items()})
    assert back["opt"][1] == {"lr": 0.1} and back["pos"] == (3, "x")
    assert torch.equal(back["model"]["w"], state["model"]["w"])


def test_flatten_rejects_colliding_names() -> None:
    with pytest.raises(ValueError, match="same name"):
        flatten({"a": {"b": torch.ones(1)}, "a/b": torch.ones(1)})


def test_reshard_plan_recuts_two_pieces_into_three() -> None:
    global_t = torch.arange(24.0).reshape(6, 4)
    pieces = [reshard.Piece(i, (3 * i, 0), (3, 4)) for i in range(2)]
    pieces += [reshard.Piece(9, (0, 0), (3, 4))]  # replica 1's copy of rank 0: read once
    for want in range(3):
        out = torch.empty(2, 4)
        copies = reshard.plan(pieces, (2 * want, 0), (2, 4))
        for c in copies:
            src = global_t[3 * c.key : 3 * c.key + 3] if c.key != 9 else global_t[0:3]
            out[c.dst] = src[c.src]
        assert torch.equal(out, global_t[2 * want : 2 * want + 2])


def test_reshard_plan_reports_a_missing_shard() -> None:
    with pytest.raises(ValueError, match="missing"):
        reshard.plan([reshard.Piece(0, (0,), (3,))], (0,), (6,), "w")


def test_objects_source_rank() -> None:
    assert [reshard.objects_source_rank(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError):
        reshard.objects_source_rank(0, 0)


def test_retention_never_deletes_newest_or_in_flight() -> None:
    # 50 is being written (incomplete); 40 is incomplete debris older than what we keep.
    assert retention.plan([50, 45, 40, 30, 20, 10], [45, 30, 20, 10], keep_last=2) == [10, 20]
    assert retention.plan([50, 45], [45], keep_last=3) == []
    assert retention.plan([5], [], keep_last=1) == []
    with pytest.raises(ValueError, match="at least 1"):
        retention.plan([1], [1], keep_last=0)
