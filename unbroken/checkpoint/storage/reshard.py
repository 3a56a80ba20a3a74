"""Re-cutting sharded tensors for a different world size, from their global offsets.

Every saved piece of a tensor records its box in the global tensor (offset and shape). A rank
of the new job asks for its own box; :func:`plan` intersects it with the saved boxes and says
which slice of which piece fills which slice of the request. Replicas saved identical pieces,
so a box saved by several replicas is read once.

Rules for the non-tensor state (the pickled objects of each shard), which has no offsets:

* rank ``w`` of the new job takes the objects saved by rank ``w % W`` (``W`` the saved world
  size) of the lowest-numbered replica that committed that rank;
* so things that are the same on every rank (step, learning-rate schedule, config) come back
  unchanged, per-rank things (RNG states) come from a deterministic saved rank, and things that
  depend on the world size (a data loader's position per rank) must be recomputed by the
  caller, who can read the saved world size from :attr:`Restored.saved_world_size`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # how the caller finds a piece again


@dataclass(frozen=True)
class Piece(Generic[K]):
    """A saved piece of a global tensor: where it is found, and its box."""

    key: K
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Copy(Generic[K]):
    """Copy ``piece[src]`` into ``request[dst]`` (slices in each one's local coordinates)."""

    key: K
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def plan(
    pieces: list[Piece[K]], offset: tuple[int, ...], shape: tuple[int, ...], name: str = "tensor"
) -> list[Copy[K]]:
    """The copies that assemble the box ``offset``/``shape`` from saved pieces.

    Raises:
        ValueError: if the saved pieces overlap inconsistently or do not cover the request,
            which means the checkpoint is missing a rank's shard.
    """
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    copies: list[Copy[K]] = []
    covered = 0
    for p in pieces:
        if len(p.offset) != len(offset):
            raise ValueError(f"{name}: saved with {len(p.offset)} dims, requested with {len(offset)}")
        box = (p.offset, p.shape)
        if box in seen:  # the same piece from another replica
            continue
        seen.add(box)
        lo = [max(a, b) for a, b in zip(p.offset, offset, strict=False)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(p.offset, p.shape, offset, shape, strict=False)]
        if any(h <= low for low, h in zip(lo, hi, strict=False)) and len(offset) > 0:
            continue
        copies.append(
            Copy(
                p.key,
                tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, p.offset, strict=False)),
                tuple(slice(low - b, h - b) for low, h, b in zip(lo, hi, offset, strict=False)),
            )
        )
        covered += math.prod(h - low for low, h in zip(lo, hi, strict=False))
    need = math.prod(shape)
    if covered != need:
        what = "overlap" if covered > need else "cover"
        raise ValueError(
            f"{name}: the saved pieces {what} {covered} of the {need} requested "
            "elements; a rank's shard is missing or the shards are inconsistent"
        )
    return copies


def objects_source_rank(new_rank: int, saved_world_size: int) -> int:
    """Which saved rank's non-tensor state a rank of the new job receives (see module doc)."""
    if saved_world_size < 1:
        raise ValueError("saved world size must be at least 1")
    return new_rank % saved_world_size
