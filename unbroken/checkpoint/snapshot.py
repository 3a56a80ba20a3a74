"""The snapshot tier: the training state copied into reused host buffers.

One implementation for both copies of a replica's state that leave the training thread: a
checkpoint (:class:`~unbroken.checkpoint.Checkpointer`) and a donor's catch-up snapshot for a
recovering peer (:mod:`unbroken.comm.catchup`). Both flatten the state into named tensors and a
pickled skeleton (:func:`flatten`), lay the tensors out back to back
(:func:`unbroken.checkpoint.storage.manifest.layout`) in a :class:`HostBuffer`, and copy with
:func:`copy_tensor`.

The buffer is an anonymous memory file (memfd) mapped into this process, so the persist process
can map the same pages by receiving its file descriptor: nothing is copied or pickled on the way
to disk. Buffers are allocated once, touched once (a fresh page costs a page fault, which makes
a first copy ~10x slower than a copy into warm memory) and only replaced when the state grows.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.checkpoint.storage.manifest import TensorEntry, TensorSpec


@dataclass
class Shard:
    """Marks a tensor as this rank's piece of a larger global tensor.

    Plain tensors in a state are taken to be whole (replicated); wrap a sharded one so that the
    checkpoint records where it sits and can be re-cut for a different world size.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


@dataclass(frozen=True)
class TensorRef:
    """Stands in for a tensor in the pickled skeleton of the state."""

    name: str
    sharded: bool


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def flatten(
    state: Any, prefix: str = "", known: dict[str, TensorSpec] | None = None
) -> tuple[dict[str, tuple[torch.Tensor, TensorSpec]], Any]:
    """Split a nested state into named tensors and a skeleton holding everything else.

    Returns ``(tensors, skeleton)``: ``tensors`` maps a path such as ``model/fc.weight`` to the
    tensor and its spec; the skeleton is the state with each tensor replaced by a
    :class:`TensorRef`, small enough to pickle on every save.

    Args:
        known: specs from an earlier call (by path); an equal one is reused rather than built
            again, so that a caller saving every step compares layouts by identity, cheaply.
    """
    tensors: dict[str, tuple[torch.Tensor, TensorSpec]] = {}
    known = known or {}

    def walk(node: Any, path: str) -> Any:
        if type(node) in _ATOMS:  # most leaves (hyperparameters, parameter ids): decided at once
            return node
        if isinstance(node, torch.Tensor):
            return add(node, path, None, None, False)
        if isinstance(node, Shard):
            return add(node.tensor, path, tuple(node.global_shape), tuple(node.global_offset), True)
        if isinstance(node, dict):
            return type(node)((k, walk(v, f"{path}/{k}" if path else str(k))) for k, v in node.items())
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node))
        return node

    def add(
        t: torch.Tensor, path: str, gshape: tuple[int, ...] | None, goff: tuple[int, ...] | None, sharded: bool
    ) -> TensorRef:
        if path in tensors:
            raise ValueError(f"two entries of the state flatten to the same name {path!r}; " "rename one of the keys")
        if t.layout is not torch.strided or t.is_quantized:
            raise ValueError(f"{path}: sparse and quantized tensors cannot be checkpointed")
        dtype, shape = _dtype_name(t.dtype), tuple(t.shape)
        if gshape is None or goff is None:  # a whole tensor: its own global tensor
            gshape, goff = shape, (0,) * len(shape)
        spec = known.get(path)
        if (
            spec is None
            or spec.dtype != dtype
            or spec.shape != shape
            or spec.global_shape != gshape
            or spec.global_offset != goff
        ):
            spec = TensorSpec(path, dtype, shape, gshape, goff)
        tensors[path] = (t, spec)
        return TensorRef(path, sharded)

    skeleton = walk(state, prefix)
    return tensors, skeleton


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], shards: dict[str, TensorEntry] | None = None) -> Any:
    """Rebuild the state from its skeleton, putting the given tensors back in place.

    With ``shards``, sharded tensors come back as :class:`Shard` carrying their offsets.
    """

    def walk(node: Any) -> Any:
        if isinstance(node, TensorRef):
            t = tensors[node.name]
            if node.sharded and shards is not None:
                e = shards[node.name]
                return Shard(t, e.global_shape, e.global_offset)
            return t
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(walk(v) for v in node)
        return node

    return walk(skeleton)


def view_bytes(data: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The bytes ``[entry.begin, entry.end)`` of the uint8 tensor ``data``, viewed as the
    entry's tensor (no copy)."""
    return data[entry.begin : entry.end].view(getattr(torch, entry.dtype)).view(entry.shape)


class HostBuffer:
    """A shareable, pre-touched, optionally pinned host buffer that only ever grows."""

    def __init__(self, nbytes: int) -> None:
        self.capacity = max(nbytes, mmap.PAGESIZE)
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("unbroken-snapshot", 0)
        else:  # pragma: no cover - non-Linux: an unlinked temporary file behaves the same
            handle = tempfile.TemporaryFile()
            self.fd = os.dup(handle.fileno())
            handle.close()
        os.ftruncate(self.fd, self.capacity)
        self.map = mmap.mmap(self.fd, self.capacity)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.bytes.fill_(0)  # touch every page now, not during the first save
        self._pinned = False
        self._views: tuple[list[TensorEntry], list[torch.Tensor]] | None = None
        if torch.cuda.is_available():
            # Registered host memory lets device->host copies run at full PCIe speed, async.
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.capacity, 0)
            self._pinned = int(err) == 0

    def view(self, entry: TensorEntry) -> torch.Tensor:
        """The region of one tensor, viewed as that tensor (no copy)."""
        return view_bytes(self.bytes, entry)

    def views(self, entries: list[TensorEntry]) -> list[torch.Tensor]:
        """:meth:`view` of every entry, kept while the same layout object is passed again
        (building 117 views cost ~1.5 ms a save; a trainer's layout rarely changes)."""
        if self._views is None or self._views[0] is not entries:
            self._views = (entries, [self.view(e) for e in entries])
        return self._views[1]

    def close(self) -> None:
        self._views = None
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self._pinned = False
        del self.bytes
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view; the OS frees it with the last one
            pass
        os.close(self.fd)


PARALLEL_COPY_MIN = 8 << 20  # below this, torch's threaded copy costs more than it saves


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, single_thread: bool = False, non_blocking: bool = False) -> None:
    """Copy ``src`` into ``dst`` (same dtype and shape), cheaply for small CPU tensors.

    Contiguous CPU tensors smaller than ``PARALLEL_COPY_MIN`` are copied with one plain
    ``memmove``: torch's copy starts a parallel region for anything over 32K elements, and on
    a machine with more runnable threads than cores each region waits for a descheduled worker
    (a 117-tensor, 5 MB state took 10-250 ms that way under load, ~1 ms by memmove).

    Args:
        single_thread: ``memmove`` whatever the size (it releases the GIL), so a copy running
            beside the training thread takes one core rather than competing for all of them.
        non_blocking: passed to torch's copy (device tensors into pinned memory).
    """
    nbytes = src.numel() * src.element_size()
    if (
        src.device.type == "cpu"
        and src.is_contiguous()
        and dst.is_contiguous()
        and nbytes
        and (single_thread or nbytes < PARALLEL_COPY_MIN)
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int = 2) -> None:
    """Copy each ``(dst, src)`` pair (a restore from memory), contiguous CPU ones by
    ``memmove`` on ``threads`` threads, each taking a share of the bytes.

    Why not torch's copy: it opens one parallel region per tensor, and when other processes
    keep the cores busy every region waits for a descheduled worker (a 1 GB, 168-tensor restore
    ran at 1.5 GB/s that way on a loaded machine, ~12 GB/s idle); here the threads meet once.
    """
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max(1, threads))]
    loads = [0] * len(groups)
    for dst, src in sorted(pairs, key=lambda p: -p[1].numel() * p[1].element_size()):
        if (
            src.device.type == "cpu"
            and dst.device.type == "cpu"
            and src.dtype == dst.dtype
            and src.shape == dst.shape
            and src.is_contiguous()
            and dst.is_contiguous()
        ):
            i = loads.index(min(loads))
            groups[i].append((dst, src))
            loads[i] += src.numel() * src.element_size()
        else:
            dst.copy_(src)

    def run(group: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in group:
            copy_tensor(dst, src, single_thread=True)

    busy = [g for g in groups if g]
    if len(busy) <= 1:
        for g in busy:
            run(g)
        return
    with ThreadPoolExecutor(len(busy), thread_name_prefix="unbroken-restore") as pool:
        list(pool.map(run, busy))


def copy_into(
    buffer: HostBuffer,
    entries: list[TensorEntry],
    tensors: dict[str, tuple[torch.Tensor, TensorSpec]],
    single_thread: bool = False,
) -> None:
    """Copy every tensor into its region of the buffer (the only work the trainer waits for);
    see :func:`copy_tensor` for ``single_thread``."""
    non_blocking = buffer._pinned
    for e, dst in zip(entries, buffer.views(entries), strict=False):
        copy_tensor(dst, tensors[e.name][0].detach(), single_thread, non_blocking)
    if non_blocking:
        torch.cuda.current_stream().synchronize()
