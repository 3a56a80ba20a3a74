"""Reading a committed step from disk into tensors, re-cut to whatever boxes are asked for.

A request is a dict ``name -> (destination tensor, spec)`` where the spec gives the box in
the global tensor. A request that matches a saved piece exactly is read straight into the
destination's memory (no allocation, checksum verified on the way), or into host memory first
where it cannot be (a device tensor); anything else is assembled from the overlapping saved
pieces by :func:`unbroken.checkpoint.reshard.plan`.
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.checkpoint import disk, history, reshard
from unbroken.checkpoint.manifest import ShardManifest, TensorEntry

STAGE_BYTES = 256 << 20  # host memory a restore into device tensors reads ahead of its copies
ALIGN = 64  # where each piece starts in that buffer: any dtype's view of it is aligned


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
                staged: list[tuple[int, TensorEntry, torch.Tensor]] = []
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


def _read_staged(
    staged: list[tuple[int, TensorEntry, torch.Tensor]], files: dict[int, disk.DataFile], pool: Executor
) -> None:
    """Reads exact pieces for destinations that cannot be read into (device tensors, strided
    views) through one host buffer of at most :data:`STAGE_BYTES`: as many pieces as fit are read
    into it together (their reads in flight at once), then copied into their destinations, and
    the buffer is reused for the next ones. A piece larger than the buffer is a batch of its own.

    One tensor at a time, a device's restore was as many reads one after another as it has
    tensors; one buffer, not one per piece, touches fresh host memory once (on this project's
    2-core VM, 2 s a GiB)."""

    def nbytes(e: TensorEntry) -> int:
        return -(-(e.end - e.begin) // ALIGN) * ALIGN

    if not staged:
        return
    buffer = torch.empty(min(STAGE_BYTES, sum(nbytes(e) for _, e, _ in staged)), dtype=torch.uint8)
    i = 0
    while i < len(staged):
        batch: list[tuple[TensorEntry, torch.Tensor, torch.Tensor]] = []
        by_rank: dict[int, list[tuple[TensorEntry, int | None]]] = {}
        used = 0
        while i < len(staged) and (not batch or used + nbytes(staged[i][1]) <= buffer.numel()):
            rank, e, dest = staged[i]
            size = nbytes(e)
            room = buffer if size <= buffer.numel() else torch.empty(size, dtype=torch.uint8)
            start = used if room is buffer else 0
            host = room[start : start + e.end - e.begin].view(dest.dtype).view(e.shape)
            batch.append((e, dest, host))
            by_rank.setdefault(rank, []).append((e, host.data_ptr() if host.numel() else None))
            used += size if room is buffer else 0
            i += 1
            if room is not buffer:
                break
        for rank, requests in by_rank.items():
            files[rank].read_many(requests, pool)
        for _, dest, host in batch:
            dest.copy_(host)


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
