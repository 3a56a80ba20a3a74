"""Pure helpers on state dicts for the torchft facade: the tensors a state holds, and which
replica's state the others take at the first step (torchft's ``init_sync``).

No processes and no groups here, so they are tested on their own
(``tests/unit/torchft/test_init_sync.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def local_tensors(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state (dicts, lists, tuples), in a fixed order: dict keys in
    insertion order, as ``state_dict()`` builds them on every replica alike. A DTensor yields
    its local shard, the part this rank holds and exchanges with the same rank of the others."""
    if isinstance(state, torch.Tensor):
        yield state.to_local() if hasattr(state, "to_local") else state
    elif isinstance(state, dict):
        for v in state.values():
            yield from local_tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from local_tensors(v)


def sync_source(
    members: tuple[int, ...] | list[int], behind: tuple[int, ...] | list[int] | frozenset[int]
) -> int | None:
    """The replica whose state every other takes in ``init_sync``, None when there is nothing
    to sync: one member, or some member is catching up (its state comes from its donor, and
    the others are past their first step)."""
    if len(members) < 2 or behind:
        return None
    return min(members)


def broadcast_by_sum(tensor: torch.Tensor, is_source: bool) -> torch.Tensor:
    """What this replica contributes to a sum that leaves the source's value everywhere:
    its own value on the source, zeros elsewhere. ``x + 0`` is exact in every float format,
    so the result is the source's bits (a ``-0.0`` becomes ``+0.0``, on every replica alike)."""
    return tensor.detach().clone() if is_source else torch.zeros_like(tensor)


def as_like(received: Any, reference: Any) -> Any:
    """``received`` with every plain tensor that stands where ``reference`` holds a DTensor made
    that DTensor again (the received tensor as its local shard, on its mesh and placements).

    unbroken sends a DTensor to a recovering replica as this rank's local shard; torchft's loaders
    (``model.load_state_dict`` of an FSDP2 model) expect the DTensors back. ``reference`` is the
    receiver's own state of the same layout, whose DTensors say where each shard goes.
    """
    if isinstance(received, torch.Tensor) and isinstance(reference, torch.Tensor):
        if hasattr(reference, "device_mesh") and not hasattr(received, "device_mesh"):
            from torch.distributed.tensor import DTensor

            ref: Any = reference
            local = received.to(ref.to_local().device)
            return DTensor.from_local(local, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride())
        return received
    if isinstance(received, dict) and isinstance(reference, dict):
        return {k: as_like(v, reference.get(k)) for k, v in received.items()}
    if isinstance(received, list | tuple) and isinstance(reference, list | tuple) and len(received) == len(reference):
        return type(received)(as_like(a, b) for a, b in zip(received, reference, strict=True))
    return received
