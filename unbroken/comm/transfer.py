"""Peer-to-peer state transfer for catch-up: snapshot at the step boundary, serve in the back.

At the step boundary the donor's training thread takes its state's structure and small
tensors and hands the large host tensors to a background thread, which copies them into a
reused host buffer while the step computes and exchanges (the forward and backward pass read
parameters but do not change them; the exchange touches only gradients); the training thread
waits for that copy only before the optimizer moves the state, by which time it is done.
Another background thread serves the buffer over TCP in checksummed chunks while the donor
keeps training. The recovering replica verifies every chunk's CRC-32C and
rebuilds the nested state dict (tensors plus plain Python objects). The checksum is CRC-32C on
the CPU's crc32 instruction (the checkpoint tiers' checksum), several times cheaper than zlib's
CRC-32 for a donor whose cores are also training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from unbroken.checkpoint.checksum import update as checksum
from unbroken.checkpoint.snapshot import copy_tensor

log = logging.getLogger(__name__)

CHUNK = 4 << 20
SOCKET_BUFFER = 8 << 20
OWN_STORAGE_BELOW = 1 << 20
BACKGROUND_COPY_MIN = 1 << 20  # host tensors this large are copied off the training thread
SERVE_NICE = 19
ALIGN = 64
_HDR = struct.Struct("!Q")
_CRC = struct.Struct("!I")


class TransferError(RuntimeError):
    """A state transfer failed or arrived corrupt."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    index: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor sits in a snapshot buffer."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _map_tensors(obj: Any, fn: Any) -> Any:
    """Rebuilds a nested dict/list/tuple, replacing every leaf that ``fn`` handles."""
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return fn(obj)


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Splits a nested state into a picklable skeleton and the list of its tensors."""
    tensors: list[torch.Tensor] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return _TensorRef(len(tensors) - 1)
        return obj

    return _map_tensors(state, leaf), tensors


def unflatten_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return _map_tensors(skeleton, lambda o: tensors[o.index] if isinstance(o, _TensorRef) else o)


def layout(tensors: list[torch.Tensor]) -> tuple[list[TensorEntry], int]:
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, offset


def _view(buf: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)


@dataclasses.dataclass
class Snapshot:
    """A copy of the state of one step, in host memory."""

    step: int
    buffer: torch.Tensor
    entries: list[TensorEntry]
    skeleton: bytes
    total: int
    readers: int = 0


class SnapshotPool:
    """Host buffers reused across snapshots: allocated once, grown when the state grows.

    A buffer being served is never overwritten; a new snapshot then takes another buffer.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() >= nbytes:
                    return self._free.pop(i)
        pin = torch.cuda.is_available()
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        buf.fill_(0)  # pre-touch: page faults now, not during the copy
        return buf

    def prewarm(self, nbytes: int) -> None:
        """Allocates and touches a buffer of ``nbytes`` on a background thread.

        A first snapshot into fresh memory runs at page-fault speed (about 1.6 GB/s here,
        against 13-20 GB/s into touched memory); doing that ahead of time keeps it off the
        donor's training thread when a peer needs its state.
        """

        def run() -> None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            buf.fill_(0)
            self.give_back(buf)

        threading.Thread(target=run, name="unbroken-snapshot-prewarm", daemon=True).start()

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class SnapshotCopy:
    """A snapshot of ``state`` whose large host tensors a background thread is still copying.

    Made on the training thread at the step boundary: the structure (pickled now, with the
    plain objects such as a data position) and the small and device tensors are taken at
    once, so they cannot move on. The large host tensors, the bulk of the bytes, are copied
    beside the gradient exchange, which does not touch them; :meth:`wait` must be called
    before anything changes the state (the optimizer step). The snapshot reaches ``publish``
    only when complete, so no peer is ever served a half-copied buffer.
    """

    def __init__(self, step: int, state: Any, pool: SnapshotPool,
                 publish: Callable[[Snapshot], None] | None = None) -> None:
        skeleton, tensors = flatten_state(state)
        entries, total = layout(tensors)
        buf = pool.take(total)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, e in zip(tensors, entries):
            if t.device.type == "cpu" and e.nbytes >= BACKGROUND_COPY_MIN:
                later.append((_view(buf, e), t.detach()))
            else:
                copy_tensor(_view(buf, e), t.detach(), non_blocking=t.is_cuda)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        self.snapshot = Snapshot(step, buf, entries, pickle.dumps(skeleton), total)
        self._publish = publish
        self._thread = threading.Thread(target=self._copy, args=(later,), name="unbroken-snapshot", daemon=True)
        self._thread.start()

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            copy_tensor(dst, src, single_thread=True)  # one core: the other is training
        if self._publish is not None:
            self._publish(self.snapshot)

    def wait(self) -> Snapshot:
        """Blocks until the copy is complete (and published); returns the snapshot."""
        self._thread.join()
        return self.snapshot


def take_snapshot(step: int, state: Any, pool: SnapshotPool) -> Snapshot:
    """Copies ``state`` into a pooled host buffer, all of it before returning."""
    return SnapshotCopy(step, state, pool).wait()


class TransferServer:
    """Serves published snapshots to recovering peers, from background threads."""

    def __init__(self, host: str = "127.0.0.1", keep: int = 2) -> None:
        self.pool = SnapshotPool()
        self._snapshots: dict[int, Snapshot] = {}
        self._keep = keep
        self._cond = threading.Condition()
        self._sock = socket.create_server((host, 0))
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        self._closed = False
        self.served: list[dict[str, float]] = []
        threading.Thread(target=self._accept, name="unbroken-transfer", daemon=True).start()

    def publish(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._snapshots[snapshot.step] = snapshot
            for step in sorted(self._snapshots)[: -self._keep]:
                old = self._snapshots[step]
                if old.readers == 0:
                    del self._snapshots[step]
                    self.pool.give_back(old.buffer)
            self._cond.notify_all()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; close alone does not
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        # Serving must not slow the donor's own training: where CPUs are scarce, this thread
        # yields to the training threads (Linux applies the nice value per thread).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SERVE_NICE)
        start, cpu_start = time.perf_counter(), time.thread_time()
        with conn:
            try:
                req = json.loads(conn.makefile("rb").readline())
                step, wait_s = int(req["step"]), float(req.get("wait_s", 60.0))
                with self._cond:
                    if not self._cond.wait_for(lambda: step in self._snapshots, timeout=wait_s):
                        conn.sendall(_HDR.pack(0))
                        return
                    snap = self._snapshots[step]
                    snap.readers += 1
                try:
                    header = json.dumps({
                        "step": snap.step, "total": snap.total, "chunk": CHUNK,
                        "entries": [dataclasses.asdict(e) for e in snap.entries],
                        "skeleton": snap.skeleton.hex(),
                    }).encode()
                    conn.sendall(_HDR.pack(len(header)) + header)
                    view = memoryview(snap.buffer.numpy())[: snap.total]
                    for off in range(0, snap.total, CHUNK):
                        chunk = view[off : off + CHUNK]
                        conn.sendall(chunk)
                        conn.sendall(_CRC.pack(checksum(chunk)))
                finally:
                    with self._cond:
                        snap.readers -= 1
                self.served.append({"step": step, "bytes": snap.total, "s": time.perf_counter() - start,
                                    "cpu_s": time.thread_time() - cpu_start})
            except (OSError, ValueError, KeyError) as e:
                log.warning("state transfer to a peer failed: %s", e)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError("the donor closed the connection mid-transfer")
        got += n


def fetch_state(address: str, step: int, timeout_s: float = 120.0, into: Any = None) -> Any:
    """Fetches the state of ``step`` from the donor at ``address`` and verifies every chunk.

    Args:
        into: the receiver's own state, nested like the donor's. A tensor of it at the same
            place, with the same dtype and shape, receives its bytes directly: no fresh
            memory to fault in and nothing to copy when the state is then loaded (loading a
            tensor into itself is free). Its contents are undefined if the fetch fails,
            which is harmless for a replica that is behind: its own state is being replaced.

    Raises:
        TransferError: the donor is unreachable, has no snapshot of ``step`` within
            ``timeout_s``, went away mid-transfer, or a chunk arrived corrupt.
    """
    host, _, port = address.rpartition(":")
    try:
        # The donor may wait up to timeout_s for the snapshot before it answers; allow for it.
        sock = socket.create_connection((host, int(port)), timeout=timeout_s + 5.0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    except OSError as e:
        raise TransferError(f"cannot reach the donor at {address}: {e}") from e
    try:
        with sock:
            return _receive(sock, address, step, timeout_s, into)
    except OSError as e:  # a reset or a timeout mid-transfer
        raise TransferError(f"the transfer from the donor at {address} failed: {e}") from e


def receive_targets(skeleton: Any, entries: list[TensorEntry], into: Any) -> list[torch.Tensor | None]:
    """For each entry, the receiver's own tensor at the same place that can take its bytes."""
    targets: list[torch.Tensor | None] = [None] * len(entries)

    def walk(theirs: Any, ours: Any) -> None:
        if isinstance(theirs, _TensorRef):
            e = entries[theirs.index]
            # Plain tensors only: a subclass (DTensor) may not own the memory its shape says.
            if (type(ours) in (torch.Tensor, torch.nn.Parameter) and ours.device.type == "cpu"
                    and ours.is_contiguous() and not ours.is_sparse
                    and str(ours.dtype).removeprefix("torch.") == e.dtype and tuple(ours.shape) == e.shape):
                targets[theirs.index] = ours
        elif isinstance(theirs, dict) and isinstance(ours, dict):
            for k, v in theirs.items():
                if k in ours:
                    walk(v, ours[k])
        elif isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)) and len(theirs) == len(ours):
            for a, b in zip(theirs, ours):
                walk(a, b)

    walk(skeleton, into)
    return targets


def _segments(entries: list[TensorEntry], targets: list[torch.Tensor | None], buf: torch.Tensor,
              total: int) -> list[tuple[int, memoryview]]:
    """The stream cut into (start, destination) pieces: a target tensor's own bytes, or the
    receive buffer for everything else (padding, tensors with no target)."""
    whole = memoryview(buf.numpy())
    out: list[tuple[int, memoryview]] = []
    pos = 0
    for e, t in sorted(zip(entries, targets), key=lambda p: p[0].offset):
        if t is None or e.nbytes == 0:
            continue
        if e.offset > pos:
            out.append((pos, whole[pos:e.offset]))
        out.append((e.offset, memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())))
        pos = e.offset + e.nbytes
    if pos < total:
        out.append((pos, whole[pos:total]))
    return out


def _receive(sock: socket.socket, address: str, step: int, timeout_s: float, into: Any) -> Any:
    sock.sendall(json.dumps({"step": step, "wait_s": timeout_s}).encode() + b"\n")
    hdr = bytearray(_HDR.size)
    _recv_exact(sock, memoryview(hdr))
    (n,) = _HDR.unpack(hdr)
    if n == 0:
        raise TransferError(f"the donor at {address} has no snapshot of step {step}")
    raw = bytearray(n)
    _recv_exact(sock, memoryview(raw))
    header = json.loads(raw)
    total, chunk_size = int(header["total"]), int(header["chunk"])
    entries = [TensorEntry(e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"]) for e in header["entries"]]
    skeleton = pickle.loads(bytes.fromhex(header["skeleton"]))
    targets = receive_targets(skeleton, entries, into) if into is not None else [None] * len(entries)
    # Pages of this buffer that only targeted tensors cover are never touched, so never faulted in.
    buf = torch.empty(max(total, 1), dtype=torch.uint8)
    segments = _segments(entries, targets, buf, total)
    crc = bytearray(_CRC.size)
    seg = 0
    for off in range(0, total, chunk_size):
        end, value = min(off + chunk_size, total), 0
        pos = off
        while pos < end:
            start, dest = segments[seg]
            if pos >= start + len(dest):
                seg += 1
                continue
            piece = dest[pos - start : min(end, start + len(dest)) - start]
            _recv_exact(sock, piece)
            value = checksum(piece, value)
            pos += len(piece)
        _recv_exact(sock, memoryview(crc))
        if value != _CRC.unpack(crc)[0]:
            raise TransferError(f"checksum mismatch in the chunk at byte {off} from {address}")
    # Small tensors get their own storage: some consumers (torch.set_rng_state) misread
    # views at an offset. Large ones stay views of the receive buffer; copying them again
    # would double the memory traffic of a catch-up for nothing.
    tensors = [
        t if t is not None else (_view(buf, e).clone() if e.nbytes < OWN_STORAGE_BELOW else _view(buf, e))
        for t, e in zip(targets, entries)
    ]
    return unflatten_state(skeleton, tensors)
