"""Live catch-up: a recovering replica fetches a donor replica's state of this very step.

Not to be confused with the checkpoint tier's peer copy (:mod:`unbroken.checkpoint.peer`),
which holds saved shards for a restart: catch-up moves the live state between two running
replicas, while the donor keeps training.

At the step boundary the donor's training thread takes its state's structure and small
tensors and hands the large host tensors to a background thread, which copies them into a
reused host buffer while the step computes and exchanges (the forward and backward pass read
parameters but do not change them; the exchange touches only gradients); the training thread
waits for that copy only before the optimizer moves the state, by which time it is done. The
snapshot is the checkpoint tier's (:mod:`unbroken.checkpoint.snapshot`): the same flattening
into named tensors and a skeleton, the same layout, the same host buffers and copy; only when
the bulk is copied differs. Another background thread serves the buffer over TCP in
checksummed chunks while the donor keeps training. The recovering replica verifies every
chunk's CRC-32C and rebuilds the nested state dict (tensors plus plain Python objects). The
checksum is CRC-32C on the CPU's crc32 instruction (the checkpoint tiers' checksum), several
times cheaper than zlib's CRC-32 for a donor whose cores are also training.

Trust: anyone who can reach the port could otherwise download the model and optimizer, or pose
as a donor. Both sides prove they hold the job's secret (:func:`~unbroken.wire.auth.server_handshake`,
purpose ``"transfer"``) before anything else; the request and the header are MACed; the bulk
bytes are bound to that connection and CRC-checked (an on-path attacker injecting packets into
an established connection is out of scope, as for Gloo). The header is bounded and validated
(its entries must tile the data as a checkpoint manifest's must), and the non-tensor objects load through
the allow-list unpickler of :mod:`unbroken.wire.objects`: even a donor holding the key cannot
make a replica run code. Connections wait for their ticket in a
:class:`~unbroken.wire.gate.Gate` (no thread, a budget apart from key holders'), every
connection has a timeout, and the transfers served at once are bounded: more recovering peers
than that queue for a slot, and a peer shed by a donor under load tries again
(:func:`fetch_state`), so neither a stranger's flood nor many recoveries at once crash a
recovering replica.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from unbroken.checkpoint.snapshot import HostBuffer, TensorRef, copy_tensor, flatten, unflatten, view_bytes
from unbroken.checkpoint.storage.checksum import update as checksum
from unbroken.checkpoint.storage.manifest import (
    TensorEntry,
    TensorSpec,
    check_entries,
    entries_from_json,
    entries_to_json,
    layout,
)
from unbroken.wire import objects
from unbroken.wire.admission import RefusalLog
from unbroken.wire.auth import AuthError, HandshakeInterrupted, JobSecret, client_handshake, server_handshake
from unbroken.wire.framing import FrameError, recv_exact_into, recv_sealed, send_sealed
from unbroken.wire.gate import Gate

log = logging.getLogger(__name__)

CHUNK = 4 << 20
SOCKET_BUFFER = 8 << 20
OWN_STORAGE_BELOW = 1 << 20
BACKGROUND_COPY_MIN = 1 << 20  # host tensors this large are copied off the training thread
SERVE_NICE = 19
_CRC = struct.Struct("!I")
PURPOSE = "transfer"
MAX_REQUEST = 1024
MAX_HEADER = 256 << 20  # entries and the skeleton of a state with a million tensors fit
MAX_WAIT_S = 600.0  # the longest a request may ask the donor to wait for its snapshot
IO_TIMEOUT_S = 60.0  # any single read or write of a connection, once the snapshot is there
MAX_SERVED_RECORDS = 256
MAX_CONNECTIONS = 8  # transfers served at once; more authenticated requests queue for a slot
MAX_WAITING = 256  # authenticated requests held at once (served or queued); more are shed, and retry
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 2.0  # a shed or busy fetch tries again after this, doubling


class TransferError(RuntimeError):
    """A state transfer failed or arrived corrupt."""


def snapshot_layout(state: Any) -> tuple[dict[str, tuple[torch.Tensor, TensorSpec]], Any, list[TensorEntry], int]:
    """``(tensors, skeleton, entries, total)`` of a state: the checkpoint tier's flattening and
    layout (:mod:`unbroken.checkpoint.snapshot`), so a donor's snapshot and a checkpoint hold a
    state the same way."""
    tensors, skeleton = flatten(state)
    entries = layout([spec for _, spec in tensors.values()])
    return tensors, skeleton, entries, max((e.end for e in entries), default=0)


def host_memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new allocations, in bytes; None where it
    does not say (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclasses.dataclass
class Snapshot:
    """A copy of the state of one step, in host memory."""

    step: int
    buffer: HostBuffer
    entries: list[TensorEntry]
    skeleton: bytes
    total: int
    readers: int = 0


class SnapshotPool:
    """Host buffers reused across snapshots: allocated once, grown when the state grows.

    A buffer being served is never overwritten; a new snapshot then takes another buffer.
    """

    def __init__(self) -> None:
        self._free: list[HostBuffer] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> HostBuffer:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.capacity >= nbytes:
                    return self._free.pop(i)
        return HostBuffer(nbytes)  # pre-touched: page faults now, not during the copy

    def prewarm(self, nbytes: int, available: int | None = None) -> bool:
        """Allocates and touches a buffer of ``nbytes`` on a background thread; whether it did.

        A first snapshot into fresh memory runs at page-fault speed (about 1.6 GB/s here,
        against 13-20 GB/s into touched memory); doing that ahead of time keeps it off the
        donor's training thread when a peer needs its state. Not where the host has little
        room: a buffer of more than a quarter of the memory ``available`` (default: the
        kernel's MemAvailable) would be held by every replica on the host for a catch-up that
        may never come, and a donation then needs a second one (torchft's ``train_ddp.py``, 3 GB
        of state per replica, ran a 24 GB machine out of memory). A donation then allocates
        its buffer when needed, at page-fault speed.
        """
        available = host_memory_available() if available is None else available
        if available is not None and nbytes > available // 4:
            log.info(
                "not reserving %.1f GB for catch-up snapshots ahead: the host has %.1f GB available",
                nbytes / 1e9,
                available / 1e9,
            )
            return False
        threading.Thread(
            target=lambda: self.give_back(HostBuffer(nbytes)), name="unbroken-snapshot-prewarm", daemon=True
        ).start()
        return True

    def give_back(self, buf: HostBuffer) -> None:
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

    def __init__(
        self, step: int, state: Any, pool: SnapshotPool, publish: Callable[[Snapshot], None] | None = None
    ) -> None:
        tensors, skeleton, entries, total = snapshot_layout(state)
        buf = pool.take(total)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e, dst in zip(entries, buf.views(entries), strict=True):
            t = tensors[e.name][0].detach()
            if t.device.type == "cpu" and e.end - e.begin >= BACKGROUND_COPY_MIN:
                later.append((dst, t))
            else:
                copy_tensor(dst, t, non_blocking=t.is_cuda)
        if any(t.is_cuda for t, _ in tensors.values()):
            torch.cuda.synchronize()
        self.snapshot = Snapshot(step, buf, entries, objects.dumps(skeleton), total)
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


class CatchupServer:
    """Serves published snapshots to recovering peers that hold the job's ``secret``, from
    background threads."""

    def __init__(self, secret: JobSecret, host: str = "127.0.0.1", keep: int = 2) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"CatchupServer needs the job's JobSecret, got {type(secret).__name__}")
        self.pool = SnapshotPool()
        self._secret = secret
        self._snapshots: dict[int, Snapshot] = {}
        self._keep = keep
        self._cond = threading.Condition()
        self._sock = socket.create_server((host, 0))
        self.address = "{}:{}".format(*self._sock.getsockname()[:2])
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._waiting = threading.BoundedSemaphore(MAX_WAITING)
        self.served: list[dict[str, float]] = []  # the latest transfers (bounded), for the benchmark
        self._refused = 0  # connections that failed authentication or sent a bad request
        self._refusals = RefusalLog(log, "refused state transfer requests")
        self.gate = Gate(self._sock, secret, PURPOSE, self._admitted, name="unbroken-transfer")

    @property
    def refused(self) -> int:
        """Connections that failed authentication or sent a bad request."""
        return self._refused + self.gate.refused

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
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # requests waiting for a snapshot are answered now
        self.gate.close()

    def _admitted(self, conn: socket.socket, ticket: bytes) -> None:
        if not self._waiting.acquire(blocking=False):
            conn.close()  # the peer sees the connection shed, and tries again (fetch_state)
            self._refusals.note(f"over {MAX_WAITING} requests held at once", time.monotonic())
            return
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            threading.Thread(
                target=self._serve, args=(conn, ticket), name="unbroken-transfer-serve", daemon=True
            ).start()
        except BaseException:
            conn.close()
            self._waiting.release()
            raise

    def _serve(self, conn: socket.socket, ticket: bytes) -> None:
        # Serving must not slow the donor's own training: where CPUs are scarce, this thread
        # yields to the training threads (Linux applies the nice value per thread).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SERVE_NICE)
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    session = server_handshake(conn, self._secret, PURPOSE, ticket=ticket)
                    step, wait_s = _parse_request(recv_sealed(conn, session, MAX_REQUEST))
                    asked = time.perf_counter()
                except (AuthError, FrameError, ValueError, OSError) as e:
                    self._refused += 1
                    self._refusals.note(str(e), time.monotonic())
                    return
                try:
                    self._send(conn, session, step, wait_s, start, asked, cpu_start)
                except OSError as e:
                    log.warning("state transfer to a peer failed: %s", e)
        finally:
            self._waiting.release()

    def _send(
        self, conn: socket.socket, session: Any, step: int, wait_s: float, start: float, asked: float, cpu_start: float
    ) -> None:
        deadline = time.monotonic() + wait_s
        with self._cond:
            if (
                not self._cond.wait_for(lambda: step in self._snapshots or self._closed, timeout=wait_s)
                or step not in self._snapshots
            ):
                send_sealed(conn, session, json.dumps({"ok": False}).encode())
                return
            snap = self._snapshots[step]
            snap.readers += 1
        try:
            # More recovering peers than slots wait their turn here, each holding only its
            # connection and this thread (within MAX_WAITING).
            if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                send_sealed(conn, session, json.dumps({"ok": False, "busy": True}).encode())
                return
            sending = time.perf_counter()
            try:
                self._send_snapshot(conn, session, snap)
            finally:
                self._slots.release()
        finally:
            with self._cond:
                snap.readers -= 1
        now = time.perf_counter()
        self.served.append(
            {
                "step": step,
                "bytes": snap.total,
                "s": now - start,
                "cpu_s": time.thread_time() - cpu_start,
                "handshake_s": asked - start,  # from the admitted connection to its request
                "wait_s": sending - asked,  # for the snapshot's copy, then a transfer slot
                "send_s": now - sending,
            }
        )
        del self.served[:-MAX_SERVED_RECORDS]

    @staticmethod
    def _send_snapshot(conn: socket.socket, session: Any, snap: Snapshot) -> None:
        header = json.dumps(
            {
                "ok": True,
                "step": snap.step,
                "total": snap.total,
                "chunk": CHUNK,
                "entries": entries_to_json(snap.entries),
                "skeleton": base64.b64encode(snap.skeleton).decode(),
            }
        ).encode()
        send_sealed(conn, session, header)
        view = memoryview(snap.buffer.bytes.numpy())[: snap.total]  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12 only
        for off in range(0, snap.total, CHUNK):
            chunk = view[off : off + CHUNK]
            conn.sendall(chunk)
            conn.sendall(_CRC.pack(checksum(chunk)))


def _parse_request(payload: bytes) -> tuple[int, float]:
    """The step asked for and how long to wait for its snapshot; ValueError if malformed."""
    req = json.loads(payload)
    if not isinstance(req, dict) or type(req.get("step")) is not int or req["step"] < 0:
        raise ValueError(f"a transfer request needs a step (an integer >= 0), got {payload[:100]!r}")
    wait_s = req.get("wait_s", 60.0)
    if type(wait_s) not in (int, float) or not math.isfinite(wait_s) or wait_s < 0:
        raise ValueError(f"a transfer request's wait_s must be a finite number >= 0, got {wait_s!r}")
    return req["step"], min(float(wait_s), MAX_WAIT_S)


def parse_header(header: Any, step: int) -> tuple[int, int, list[TensorEntry], Any]:
    """``(total, chunk, entries, skeleton)`` of a donor's header, each checked.

    The entries must tile the data exactly as a checkpoint's manifest must
    (:func:`~unbroken.checkpoint.storage.manifest.check_entries`): every byte the receiver writes then
    lies inside the buffer it allocated or a tensor of the same size, and every tensor the
    skeleton refers to is listed.

    Raises:
        TransferError: a field is missing, of the wrong type, out of range or inconsistent.
    """
    try:
        if not isinstance(header, dict) or header.get("step") != step:
            got = header.get("step") if isinstance(header, dict) else header
            raise TransferError(f"the donor answered for step {got!r}, not {step}")
        total, chunk = header["total"], header["chunk"]
        if type(total) is not int or type(chunk) is not int or not 1 <= chunk <= 1 << 30:
            raise TransferError(f"the donor sent a bad total {total!r} or chunk size {chunk!r}")
        entries = entries_from_json(header["entries"])
        try:
            laid_out = check_entries(entries)
        except ValueError as e:
            raise TransferError(f"the donor's layout does not hold together: {e}") from e
        if total != laid_out:
            raise TransferError(f"the donor announced {total} bytes for a layout of {laid_out}")
        skeleton = objects.loads(base64.b64decode(header["skeleton"], validate=True))
        placeholder = torch.empty(0)
        unflatten(skeleton, {e.name: placeholder for e in entries})  # every reference is listed
    except TransferError:
        raise
    except objects.UnsafeObjectError as e:
        raise TransferError(f"the donor's state was refused: {e}") from e
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise TransferError(f"the donor sent a malformed header: {type(e).__name__}: {e}") from e
    return total, chunk, entries, skeleton


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """:func:`~unbroken.wire.framing.recv_exact_into`, its error said as a transfer's."""
    try:
        recv_exact_into(sock, view)
    except FrameError as e:
        raise TransferError(f"the donor closed the connection mid-transfer: {e}") from e


def fetch_state(address: str, step: int, secret: JobSecret, timeout_s: float = 120.0, into: Any = None) -> Any:
    """Fetches the state of ``step`` from the donor at ``address`` and verifies every chunk.

    Args:
        secret: the job's secret: the donor must prove it holds it, and so must we.
        into: the receiver's own state, nested like the donor's. A tensor of it at the same
            place, with the same dtype and shape, receives its bytes directly: no fresh
            memory to fault in and nothing to copy when the state is then loaded (loading a
            tensor into itself is free). Its contents are undefined if the fetch fails,
            which is harmless for a replica that is behind: its own state is being replaced.

    Raises:
        TransferError: the donor is unreachable, does not hold the job's secret, has no
            snapshot of ``step`` within ``timeout_s``, went away mid-transfer, sent a header
            that does not hold together or objects outside the allow-list, or a chunk arrived
            corrupt.
    """
    deadline = time.monotonic() + timeout_s
    delay = RETRY_FIRST_S
    while True:
        try:
            return _fetch_once(address, step, secret, max(0.0, deadline - time.monotonic()), into)
        except _Shed as e:
            # Shed by a donor under load (a flood, or more recoveries than its slots): nothing
            # has been written into ``into`` yet, so trying again later is safe.
            if time.monotonic() + delay >= deadline:
                raise TransferError(f"the donor at {address} stayed too busy for {timeout_s:.0f} s: {e}") from e
            log.info("the donor at %s is busy (%s); trying again in %.2f s", address, e, delay)
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)


class _Shed(Exception):
    """The donor closed the connection before it answered, or said it is busy: try again."""


def _fetch_once(address: str, step: int, secret: JobSecret, timeout_s: float, into: Any) -> Any:
    host, _, port = address.rpartition(":")
    try:
        # The donor may wait up to timeout_s for the snapshot before it answers; allow for it.
        sock = socket.create_connection((host, int(port)), timeout=timeout_s + 5.0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    except (OSError, ValueError) as e:
        raise TransferError(f"cannot reach the donor at {address}: {e}") from e
    try:
        with sock:
            try:
                session = client_handshake(sock, secret, PURPOSE)
            except HandshakeInterrupted as e:
                raise _Shed(str(e)) from e
            send_sealed(sock, session, json.dumps({"step": step, "wait_s": timeout_s}).encode())
            try:
                header = json.loads(recv_sealed(sock, session, MAX_HEADER))
            except FrameError as e:  # closed before the header: shed after the handshake
                raise _Shed(str(e)) from e
            sock.settimeout(min(timeout_s + 5.0, IO_TIMEOUT_S))
            if isinstance(header, dict) and header.get("ok") is False:
                if header.get("busy") is True:
                    raise _Shed("all its transfer slots stayed taken")
                raise TransferError(f"the donor at {address} has no snapshot of step {step}")
            return _receive(sock, address, parse_header(header, step), into)
    except AuthError as e:
        raise TransferError(f"the donor at {address} failed authentication: {e}") from e
    except ValueError as e:  # a header that is not JSON
        raise TransferError(f"the donor at {address} sent a malformed header: {e}") from e
    except OSError as e:  # a reset or a timeout mid-transfer
        raise TransferError(f"the transfer from the donor at {address} failed: {e}") from e


def receive_targets(skeleton: Any, entries: list[TensorEntry], into: Any) -> dict[str, torch.Tensor]:
    """The receiver's own tensors that can take an entry's bytes: the one at the same place in
    ``into``, with the same dtype and shape, by entry name. A host tensor receives the bytes
    straight from the socket; a device tensor (CUDA) is copied into from the receive buffer once
    every chunk is verified."""
    by_name = {e.name: e for e in entries}
    targets: dict[str, torch.Tensor] = {}

    def walk(theirs: Any, ours: Any) -> None:
        if isinstance(theirs, TensorRef):
            e = by_name[theirs.name]
            # Plain tensors only: a subclass (DTensor) may not own the memory its shape says.
            if (
                type(ours) in (torch.Tensor, torch.nn.Parameter)
                and ours.is_contiguous()
                and not ours.is_sparse
                and str(ours.dtype).removeprefix("torch.") == e.dtype
                and tuple(ours.shape) == e.shape
            ):
                targets[e.name] = ours
        elif isinstance(theirs, dict) and isinstance(ours, dict):
            for k, v in theirs.items():
                if k in ours:
                    walk(v, ours[k])
        elif isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)) and len(theirs) == len(ours):
            for a, b in zip(theirs, ours, strict=False):
                walk(a, b)

    walk(skeleton, into)
    return targets


def _segments(
    entries: list[TensorEntry], targets: dict[str, torch.Tensor], buf: torch.Tensor, total: int
) -> list[tuple[int, memoryview]]:
    """The stream cut into (start, destination) pieces: a target tensor's own bytes, or the
    receive buffer for everything else (padding, tensors with no target)."""
    whole = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12 only
    out: list[tuple[int, memoryview]] = []
    pos = 0
    for e in sorted(entries, key=lambda e: e.begin):
        t = targets.get(e.name)
        if t is None or e.end == e.begin or t.device.type != "cpu":
            continue
        if e.begin > pos:
            out.append((pos, whole[pos : e.begin]))
        flat = t.detach().reshape(-1).view(torch.uint8).numpy()
        out.append((e.begin, memoryview(flat)))  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12 only
        pos = e.end
    if pos < total:
        out.append((pos, whole[pos:total]))
    return out


def _receive(sock: socket.socket, address: str, parsed: tuple[int, int, list[TensorEntry], Any], into: Any) -> Any:
    total, chunk_size, entries, skeleton = parsed
    targets = receive_targets(skeleton, entries, into) if into is not None else {}
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
            _recv_into(sock, piece)
            value = checksum(piece, value)
            pos += len(piece)
        _recv_into(sock, memoryview(crc))
        if value != _CRC.unpack(crc)[0]:
            raise TransferError(f"checksum mismatch in the chunk at byte {off} from {address}")
    # Small tensors get their own storage: some consumers (torch.set_rng_state) misread
    # views at an offset. Large ones stay views of the receive buffer; copying them again
    # would double the memory traffic of a catch-up for nothing.
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        t = targets.get(e.name)
        if t is None:
            t = view_bytes(buf, e)
            tensors[e.name] = t.clone() if e.end - e.begin < OWN_STORAGE_BELOW else t
        else:
            if t.device.type != "cpu":
                with torch.no_grad():
                    t.copy_(view_bytes(buf, e))
            tensors[e.name] = t
    return unflatten(skeleton, tensors)
