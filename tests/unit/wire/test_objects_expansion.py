"""A skeleton's bytes cannot make its load (or a walk of it) take exponential time.

Pickle's memo lets a few bytes describe a value in which every level refers twice to the
level below: 137 bytes of allow-listed tuples took 7 s to load (hashing, as a set or a dict key
must, walks every path), doubling with each level. Such bytes are refused in time linear in
their length, and ordinary sharing (one tuple of betas in every parameter group) still loads.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections import OrderedDict

import pytest
import torch

from unbroken.checkpoint.snapshot import flatten, unflatten
from unbroken.wire import objects


def doubling(levels: int, last: bytes) -> bytes:
    """PROTO 4, (); then per level: the level below twice, as a 2-tuple; then ``last`` over it."""
    out = bytearray(b"\x80\x04)\x94")
    for i in range(levels):
        ref = b"j" + i.to_bytes(4, "little")  # LONG_BINGET i
        out += ref + ref + b"\x86\x94"  # TUPLE2, MEMOIZE
    top = b"j" + levels.to_bytes(4, "little")
    return bytes(out + last.replace(b"TOP", top) + b".")


@pytest.mark.parametrize(
    "last",
    [
        b"(TOP\x91",  # frozenset({top}): hashes top
        b"}TOPK\x01s",  # {top: 1}: hashes top
        b"TOP",  # top itself: any walk of it (unflatten, ==, repr) is exponential
    ],
    ids=["frozenset", "dict-key", "bare"],
)
def test_a_deeply_shared_value_is_refused_fast(last: bytes) -> None:
    for levels in (30, 60, 2000):
        data = doubling(levels, last)
        began = time.perf_counter()
        with pytest.raises(objects.UnsafeObjectError, match="shared references|nest containers"):
            objects.loads(data)
        # Unbounded, level 30 alone would take minutes: each level doubles the work.
        assert time.perf_counter() - began < 1.0, (levels, len(data))


def test_a_value_that_contains_itself_is_refused() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(objects.UnsafeObjectError, match="contain themselves"):
        objects.loads(pickle.dumps(loop))


def test_malformed_bytes_are_refused() -> None:
    good = objects.dumps({"lr": 0.1, "betas": (0.9, 0.999)})
    for bad in (good[:-1], good[:5], b"\x80\x04h\x07.", b""):
        with pytest.raises(objects.UnsafeObjectError):
            objects.loads(bad)


def test_ordinary_sharing_and_every_allowed_type_still_load_in_every_protocol() -> None:
    betas = (0.9, 0.999)
    value = {
        "groups": [{"lr": 0.1 * i, "betas": betas, "params": list(range(i, i + 3))} for i in range(1000)],
        "od": OrderedDict(a=1, b=[None, True, 2.5, "s", b"b"]),
        "sets": ({1, 2}, frozenset({(1, 2), "x"})),
        "torch": (torch.Size([2, 3]), torch.float16, torch.device("cpu"), complex(1, 2), slice(1, 5)),
    }
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert objects.loads(pickle.dumps(value, protocol=protocol)) == value


def test_a_large_real_skeleton_loads_and_its_check_is_linear() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2000)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros(2)
    opt.step()
    _, skeleton = flatten({"optim": opt.state_dict(), "step": 3})
    data = objects.dumps(skeleton)
    expanded, distinct = objects.expanded_size(data)
    assert distinct <= expanded <= 2 * distinct  # the shared betas and strings, nothing more
    began = time.perf_counter()
    loaded = objects.loads(data)
    print(f"\n{len(data)} bytes, {distinct} items: checked and loaded in {time.perf_counter() - began:.3f} s")
    assert loaded["step"] == 3 and len(loaded["optim"]["state"]) == 2000


def padded(levels: int, pad: int) -> bytes:
    """:func:`doubling` (bare), in a list after ``pad`` distinct items (NONE, a byte each) that
    raise what the bytes may describe."""
    top = b"j" + levels.to_bytes(4, "little")
    body = doubling(levels, b"")[:-1]
    return body + b"](" + b"N" * pad + top + b"e."  # EMPTY_LIST, MARK, NONE..., top, APPENDS


def test_a_small_skeleton_cannot_buy_a_long_walk() -> None:
    """381 bytes once described a million items (the flat allowance), 1.4 s to walk on
    rebuilding the state: what bytes may describe is now linear in their length. (CPU time of
    this thread: other tests' daemon threads may still be running.)"""
    for levels in range(8, 30):
        data = padded(levels, 381 - len(padded(levels, 0)))
        began = time.thread_time()
        try:
            skeleton = objects.loads(data)
        except objects.UnsafeObjectError as e:
            assert "shared references" in str(e) and "distinct" in str(e)
        else:
            unflatten(skeleton, {})  # what a restore does with it
        assert time.thread_time() - began < 0.25, (levels, len(data))
    assert len(data) == 381


def test_containers_nested_past_the_bound_are_refused_fast() -> None:
    for depth in (objects.MAX_DEPTH + 1, 5_000, 200_000):
        data = b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."  # [[[...]]] by EMPTY_LIST, APPEND
        began = time.thread_time()
        with pytest.raises(objects.UnsafeObjectError, match=f"nest containers {depth} deep; at most"):
            objects.loads(data)
        assert time.thread_time() - began < 3.0  # the unbounded walk takes minutes; a loaded machine, seconds
    ok = pickle.dumps(functools.reduce(lambda inner, _: [inner], range(objects.MAX_DEPTH - 1), [1]))
    assert objects.measure(ok)[2] == objects.MAX_DEPTH
    unflatten(objects.loads(ok), {})
