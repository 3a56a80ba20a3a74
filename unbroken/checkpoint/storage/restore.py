"""Reading a committed step from disk into tensors, re-cut to whatever boxes are asked for.

A request is a dict ``name -> (destination tensor, spec)`` where the spec gives the box in
the global tensor. A request that matches a saved piece exactly is read straight into the
destination's memory (no allocation, checksum verified on the way), or into host memory first
where it cannot be (a device tensor); anything else is assembled from the overlapping saved
pieces by :func:`unbroken.checkpoint.storage.reshard.plan`.
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.checkpoint.storage import disk, history, reshard
from unbroken.checkpoint.storage.manifest import ShardManifest, TensorEntry

STAGE_BYTES = 256 << 20  # host memory a restore into device tensors reads ahead of its copies
ALIGN = 64  # where each piece starts in that buffer: any dtype's view of it is aligned

Staged = tuple[int, TensorEntry, torch.Tensor]  # (rank of the file, the piece, its destination)


@dataclass
class StepShards:
    """The committed shards of one step: one per saved rank (replicas are interchangeable)."""

    dirs: dict[int, str]
    manifests: dict[int, ShardManifest]

    @property
    def world_size(self) -> int:
        return next(iter(self.manifests.values())).world_size

    def objects(self, rank: int) -> bytes:
        return disk.read_objects(self.dirs[rank], self.manifests[rank])

    def read(self, want: dict[str, tuple[torch.Tensor, Any]]) -> dict[str, torch.Tensor]:
        """Fill each requested destination from the saved pieces; returns name -> tensor.

        Exact matches are read straight into the destination tensors, all of a file's in one
        batch so that several reads are in flight at once. An exact match whose destination is
        not host memory it can be read into (a device tensor, a strided view) is read the same
        way into host tensors, :data:`STAGE_BYTES` at a time, and copied in from there.
        """
        files = {rank: disk.DataFile.open(self.dirs[rank], m) for rank, m in self.manifests.items()}
        by_name = {rank: {e.name: e for e in m.tensors} for rank, m in self.manifests.items()}
        try:
            with ThreadPoolExecutor(disk.READERS, thread_name_prefix="unbroken-read") as pool:
                batches: dict[int, list[tuple[TensorEntry, int | None]]] = {}
                staged: list[Staged] = []
                cuts = []
                for name, (dest, spec) in want.items():
                    pieces = [(rank, by_name[rank][name]) for rank in sorted(by_name) if name in by_name[rank]]
                    if not pieces:
                        raise ValueError(f"tensor {name!r} is not in the checkpoint")
                    exact = [
                        (r, e)
                        for r, e in pieces
                        if e.global_offset == tuple(spec.global_offset) and e.shape == tuple(spec.shape)
                    ]
                    if not exact or str(dest.dtype).removeprefix("torch.") != exact[0][1].dtype:
                        cuts.append((name, dest, spec, pieces))
                    elif dest.is_contiguous() and dest.device.type == "cpu":
                        rank, e = exact[0]
                        batches.setdefault(rank, []).append((e, dest.data_ptr() if dest.numel() else None))
                    else:
                        staged.append((*exact[0], dest))
                for rank, requests in batches.items():
                    files[rank].read_many(requests, pool)
                _read_staged(staged, files, pool)
                for name, dest, spec, pieces in cuts:
                    _assemble(name, dest, spec, pieces, files, pool)
            return {name: dest for name, (dest, _) in want.items()}
        finally:
            for f in files.values():
                f.close()


def open_step(root: str, step: int, fences: history.Fences | None = None) -> StepShards:
    """Manifests of a step's shards, one per rank, lowest replica first, of the job's current
    history (``fences``: the rollbacks, read from ``root`` when not given)."""
    dirs = disk.step_readers(root, step, fences)
    if not dirs:
        raise disk.CorruptCheckpoint(f"step {step} has no committed shard in {root}")
    return StepShards(dirs, {rank: disk.read_manifest(path) for rank, path in dirs.items()})


def _read_staged(staged: list[Staged], files: dict[int, disk.DataFile], pool: Executor) -> None:
    """Reads exact pieces for destinations that cannot be read into (device tensors, strided
    views) through one host buffer of at most :data:`STAGE_BYTES`: as many pieces as fit are read
    into it together (their reads in flight at once), then copied into their destinations, and
    the buffer is reused for the next ones. A piece larger than the buffer is a batch of its own.

    One tensor at a time, a device's restore was as many reads one after another as it has
    tensors; one buffer, not one per piece, touches fresh host memory once (on this project's
    2-core VM, 2 s a GiB)."""
    if not staged:
        return
    batches = _stage_batches(staged, STAGE_BYTES)
    buffer = torch.empty(min(STAGE_BYTES, max(size for _, size in batches)), dtype=torch.uint8)
    for batch, size in batches:
        room = buffer if size <= buffer.numel() else torch.empty(size, dtype=torch.uint8)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_rank: dict[int, list[tuple[TensorEntry, int | None]]] = {}
        offset = 0
        for rank, e, dest in batch:
            host = room[offset : offset + e.end - e.begin].view(dest.dtype).view(e.shape)
            offset += _aligned(e)
            copies.append((dest, host))
            by_rank.setdefault(rank, []).append((e, host.data_ptr() if host.numel() else None))
        for rank, requests in by_rank.items():
            files[rank].read_many(requests, pool)
        for dest, host in copies:
            dest.copy_(host)


def _aligned(e: TensorEntry) -> int:
    """The bytes ``e`` takes in the staging buffer: the next piece starts :data:`ALIGN`-aligned."""
    return -(-(e.end - e.begin) // ALIGN) * ALIGN


def _stage_batches(staged: list[Staged], capacity: int) -> list[tuple[list[Staged], int]]:
    """``staged`` in order, cut into batches of at most ``capacity`` bytes (a larger piece alone),
    each with the bytes it takes."""
    batches: list[tuple[list[Staged], int]] = []
    for item in staged:
        size = _aligned(item[1])
        if batches and batches[-1][1] + size <= capacity:
            batches[-1][0].append(item)
            batches[-1] = (batches[-1][0], batches[-1][1] + size)
        else:
            batches.append(([item], size))
    return batches


def _assemble(
    name: str,
    dest: torch.Tensor,
    spec: Any,
    pieces: list[tuple[int, TensorEntry]],
    files: dict[int, disk.DataFile],
    pool: Executor,
) -> None:
    plan = reshard.plan(
        [reshard.Piece(i, e.global_offset, e.shape) for i, (_, e) in enumerate(pieces)],
        tuple(spec.global_offset),
        tuple(spec.shape),
        name,
    )
    for c in plan:
        rank, e = pieces[c.key]
        piece = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        files[rank].read_many([(e, piece.data_ptr() if piece.numel() else None)], pool)
        dest[c.dst].copy_(piece[c.src].to(dest.dtype))
