"""``IcclRing``: a CPU-driven ring all-reduce that survives the loss of a path to its successor.

Each member holds two connections to its successor, one per path (primary and backup: two
interfaces, two subnets), and accepts the same two from its predecessor. Four threads run
for the ring's life: a sender (chunks to the successor, on the hop's active path), a receiver
(chunks from the predecessor, on whichever path they come, verified, added in place), an
acknowledgement reader per outgoing connection, and a prober that redials a path that went
down. A failed or stalled primary moves the hop to the backup, which resends what the peer had
not acknowledged; when a redial of the primary answers, the hop goes back to it. The collective
in flight completes with the right sum; only when both paths of a hop are gone does it fail.

Built once per quorum epoch (the members' addresses come from the epoch's rendezvous store,
:meth:`IcclRing.rendezvous`); every member must start the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from unbroken.comm.iccl import protocol as p
from unbroken.comm.iccl.conn import (
    POLL_S,
    SOCKET_BUFFER,
    Listener,
    PathAddrs,
    dial,
    read_inbound,
    recv_exact_into,
    send_all,
    set_recv_timeout,
    shut,
)
from unbroken.comm.iccl.monitor import PATH_LOG, LinkWatch
from unbroken.comm.iccl.work import FaultHook, IcclWork, RingBroken
from unbroken.wire.auth import AuthError, JobSecret
from unbroken.wire.framing import FrameError

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
WINDOW_CHUNKS = 8
ACK_EVERY = 2  # chunks per acknowledgement (cumulative; the last chunk of a collective always)
_DRAIN = 1 << 20
WHOLE_WAIT_S = 3.0
STALL_S = 0.3
_NET_ERRORS = (OSError, p.ProtocolError, FrameError, AuthError)


@dataclasses.dataclass
class _Op:
    seq: int
    tensor: torch.Tensor
    raw: memoryview  # the tensor's bytes
    esize: int
    sched: p.RingSchedule
    window: p.SendWindow
    cursor: p.RecvCursor
    work: IcclWork
    posted: list[float]
    fwd_crc: dict[int, int]
    send_done: bool = False
    recv_done: bool = False


class IcclRing:
    """The ring of one epoch. ``start(tensor)`` sums a flat CPU tensor in place across members.

    Args:
        secret: the job's secret; every connection proves it.
        rank, size: this member's place in the ring (size >= 2).
        listener: this member's listening sockets (their addresses were published).
        peers: every member's addresses, by rank.
        ring_id: names the ring in every hello (a connection for another ring is refused).
        stall_s: the bound on a stalled path: unacknowledged bytes (the kernel's TCP timeout)
            or a frame stopped midway for this long fail the path.
        chunk_bytes, window_chunks: the unit of pipelining and of resend; at most
            ``window_chunks`` unacknowledged chunks per hop.
        fault: alters outgoing chunks (tests, ``nic_corrupt``).
        host, interfaces: names for this member's host and paths in the diagnosis.
    """

    def __init__(
        self,
        secret: JobSecret,
        rank: int,
        size: int,
        listener: Listener,
        peers: list[PathAddrs],
        *,
        ring_id: str = "",
        stall_s: float = STALL_S,
        chunk_bytes: int = CHUNK_BYTES,
        window_chunks: int = WINDOW_CHUNKS,
        probe_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        fault: FaultHook | None = None,
        host: str = "",
        interfaces: tuple[str, str] = ("primary", "backup"),
        socket_buffer: int | None = SOCKET_BUFFER,
        monitor: bool = True,
    ) -> None:
        if size < 2 or not 0 <= rank < size or len(peers) != size:
            raise ValueError(
                f"an ICCL ring needs size >= 2, 0 <= rank < size and one address per member; "
                f"got rank {rank}, size {size}, {len(peers)} addresses"
            )
        if stall_s <= 0 or chunk_bytes < 64 or window_chunks < 1:
            raise ValueError(
                f"need stall_s > 0, chunk_bytes >= 64, window_chunks >= 1; got {stall_s}, "
                f"{chunk_bytes}, {window_chunks}"
            )
        self._secret, self.rank, self.size = secret, rank, size
        self.succ, self.pred = (rank + 1) % size, (rank - 1) % size
        self._succ_addrs = peers[self.succ]
        self._listener = listener
        self.ring_id, self.stall_s, self.chunk_bytes = ring_id, stall_s, chunk_bytes
        self._window, self._probe_s, self._fault = window_chunks, probe_s, fault
        self._buffer = socket_buffer
        self._monitor = monitor  # off only to measure what the window monitor costs
        self._cv = threading.Condition()
        self._out: list[socket.socket | None] = [None, None]
        self._in: list[socket.socket | None] = [None, None]
        self.paths = p.HopPaths()
        self.watch = LinkWatch(host or f"rank{rank}", interfaces, self.succ)
        self._ops: dict[int, _Op] = {}
        self._next_seq = 0
        self._rseq = 0  # the collective the receiver takes chunks of (only the receiver moves it)
        self._error: BaseException | None = None
        self._closed = False
        self._scratch = torch.empty(chunk_bytes, dtype=torch.uint8)
        self._scratch_raw = _bytes_of(self._scratch)
        self._discard = bytearray(_DRAIN)
        self.corrupt_chunks = 0
        listener.attach(self._inbound)
        self._threads = [
            threading.Thread(target=self._guard(self._send_loop), name="unbroken-iccl-send", daemon=True),
            threading.Thread(target=self._guard(self._recv_loop), name="unbroken-iccl-recv", daemon=True),
            threading.Thread(target=self._guard(self._probe_loop), name="unbroken-iccl-probe", daemon=True),
        ]
        for t in self._threads:
            t.start()
        # Ready when a path works each way; both paths are waited for a little longer (a
        # missing one is redialled by the prober, but a ring that starts whole is the norm).
        deadline = time.monotonic() + connect_timeout_s
        whole_by: float | None = None
        with self._cv:
            while time.monotonic() < deadline and self._error is None:
                one_way = any(self.paths.up) and any(s is not None for s in self._in)
                if all(self.paths.up) and all(s is not None for s in self._in):
                    break
                if one_way:
                    whole_by = whole_by or time.monotonic() + WHOLE_WAIT_S
                    if time.monotonic() > whole_by:
                        break
                self._cv.wait(0.05)
            ok = any(self.paths.up) and any(s is not None for s in self._in)
        if not ok:
            self.close()
            raise RingBroken(
                f"rank {rank} was not connected to its successor ({self._succ_addrs}) and from its "
                f"predecessor on any path in {connect_timeout_s} s"
            )

    # -- construction from the rendezvous store ------------------------------------------------

    @classmethod
    def rendezvous(
        cls,
        secret: JobSecret,
        rank: int,
        size: int,
        store: Any,
        hosts: tuple[str, str],
        timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> IcclRing:
        """Listens on ``hosts`` (primary, backup), publishes those addresses in ``store`` (the
        epoch's prefix store), reads every member's, and connects the ring."""
        listener = Listener(secret, hosts, kwargs.get("stall_s", STALL_S), kwargs.get("socket_buffer", SOCKET_BUFFER))
        try:
            store.set(f"iccl/{rank}", listener.addrs.to_json())
            keys = [f"iccl/{r}" for r in range(size)]
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            peers = [PathAddrs.from_json(bytes(store.get(k))) for k in keys]
            ring = cls(secret, rank, size, listener, peers, connect_timeout_s=timeout_s, **kwargs)
        except BaseException:
            listener.close()
            raise
        try:
            # Every member connected before any starts: the first collective then waits for no
            # one's connections (its deadline is the exchange's, not the rendezvous').
            store.set(f"iccl/ready/{rank}", b"1")
            store.wait([f"iccl/ready/{r}" for r in range(size)], datetime.timedelta(seconds=timeout_s))
        except BaseException:
            ring.close()
            raise
        return ring

    # -- the caller's surface ------------------------------------------------------------------

    def start(self, tensor: torch.Tensor) -> IcclWork:
        """Starts summing ``tensor`` (CPU, contiguous) in place; returns its future at once."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"the ICCL ring sums contiguous CPU tensors, got a {tensor.device} tensor "
                f"(contiguous: {tensor.is_contiguous()}); copy it to the host first"
            )
        flat = tensor.view(-1)
        esize = flat.element_size()
        sched = p.RingSchedule(flat.numel(), self.size, self.rank, max(1, self.chunk_bytes // esize))
        work = IcclWork()
        with self._cv:
            if self._error is not None or self._closed:
                work._finish(RingBroken(f"the ring is broken: {self._error or 'closed'}"))
                return work
            seq = self._next_seq
            self._next_seq += 1
            op = _Op(
                seq,
                flat,
                _bytes_of(flat),
                esize,
                sched,
                p.SendWindow(sched.total, self._window),
                p.RecvCursor(sched.total),
                work,
                [0.0] * sched.total,
                {},
            )
            self._ops[seq] = op
            self._cv.notify_all()
        return work

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> IcclWork:
        """The backend's call shape (one tensor; the ring only sums), so that a process group's
        code drives the ring as it drives Gloo: ``ring.allreduce([t], opts).get_future()``."""
        if len(tensors) != 1:
            raise ValueError(f"the ICCL ring sums one tensor per call, got {len(tensors)}")
        return self.start(tensors[0])

    def close(self, wait_s: float = 0.0) -> None:
        """Ends the ring: pending collectives fail, connections and listeners close. Never blocks
        longer than ``wait_s`` (its threads end on their own within a fraction of a second)."""
        with self._cv:
            self._closed = True
            self._fail(RingBroken("the ring was closed"))
            socks = [s for s in (*self._out, *self._in) if s is not None]
            self._out, self._in = [None, None], [None, None]
            self._cv.notify_all()
        for s in socks:
            shut(s)
        self._listener.close()
        end = time.monotonic() + wait_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    @property
    def min_deadline_s(self) -> float:
        """The shortest wait for a collective that leaves room for one failover: the stall bound,
        the resend of a window, and slack. A caller's deadline below it would call a hop that is
        moving to its backup a hang."""
        return 2 * self.stall_s + 0.5

    def link_stats(self) -> list[dict[str, Any]]:
        """Per outgoing connection: its monitor's figures and its failures (the diagnosis' input)."""
        with self._cv:
            return self.watch.stats(self.paths)

    # -- internals: bookkeeping under the lock -----------------------------------------------

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a dead thread must fail the ring, not hang it
                with self._cv:
                    if not self._closed:
                        log.exception("an ICCL thread failed")
                    self._fail(RingBroken(f"{threading.current_thread().name} failed: {e!r}"))
                    self._cv.notify_all()

        return run

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        ops, self._ops = list(self._ops.values()), {}
        for op in ops:
            op.work._finish(self._error)

    def _maybe_finish(self, op: _Op) -> None:
        if op.send_done and op.recv_done and self._ops.get(op.seq) is op:
            del self._ops[op.seq]
            op.work._finish(None)

    def _path_failed(self, path: int, sock: socket.socket, why: str) -> None:
        """``sock`` (outgoing, on ``path``) failed: close it; move the hop; resend unacknowledged."""
        if self._out[path] is not sock:
            return
        self._out[path] = None
        shut(sock)
        was_active = self.paths.active == path
        failovers = self.paths.failovers
        ok = self.paths.failed(path, time.time(), why)
        self.watch.failed(path, why)
        if self.paths.failovers > failovers:
            self.watch.event(p.BACKUP, "failover")
        if was_active:
            for op in self._ops.values():
                op.window.rewind()
        if not ok and not self._closed:
            self._fail(RingBroken(f"both paths from rank {self.rank} to rank {self.succ} failed ({why})"))
        self._cv.notify_all()

    # -- the sender ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        seq = 0
        while True:
            with self._cv:
                while seq not in self._ops:
                    if self._closed:
                        return
                    if self._error is not None and seq >= self._next_seq:
                        self._cv.wait(0.2)
                        continue
                    self._cv.wait(0.2)
                op = self._ops[seq]
            self._send_op(op)
            seq += 1

    def _send_op(self, op: _Op) -> None:
        win, sched = op.window, op.sched
        while True:
            with self._cv:
                while True:
                    if self._closed or self._ops.get(op.seq) is not op:
                        return
                    if win.done:
                        op.send_done = True
                        self._maybe_finish(op)
                        return
                    if self.paths.want_failback() and win.quiet and self._out[p.PRIMARY] is not None:
                        self.paths.failback(time.time())
                        self.watch.event(p.PRIMARY, "failback")
                    path = self.paths.active
                    sock = self._out[path]
                    if (
                        sock is not None
                        and win.can_send()
                        and op.cursor.expected >= sched.received_before_send(win.next)
                    ):
                        i = win.sent()
                        break
                    self._cv.wait(0.1)
                a, b = sched.send_item(i)
                prev = i - sched.chunks_per_step
                known_crc = op.fwd_crc.get(prev) if prev >= 0 else None
            data = op.raw[a * op.esize : b * op.esize]
            crc = known_crc if known_crc is not None else p.crc_of(data)
            wire = self._fault.payload(op.seq, i, path, data) if self._fault is not None else data
            header = p.pack(p.Kind.DATA, path, op.seq, i, len(data), crc)
            op.posted[i] = time.perf_counter()
            try:
                send_all(sock, header, wire)
            except OSError as e:
                with self._cv:
                    self._path_failed(path, sock, f"send failed: {e}")
            else:
                if self._monitor:
                    self.watch.sent(path, len(data))

    def _ack_loop(self, path: int, sock: socket.socket) -> None:
        header = bytearray(p.HEADER_BYTES)
        view = memoryview(header)
        try:
            while True:
                recv_exact_into(sock, view)
                f = p.unpack(header, 0)
                now = time.perf_counter()
                with self._cv:
                    op = self._ops.get(f.seq)
                    if op is not None and f.kind is p.Kind.ACK:
                        before = op.window.acked
                        if op.window.ack(f.chunk) and self._monitor:
                            first = op.posted[before]
                            self.watch.acked(
                                path,
                                (op.window.acked - before) * self.chunk_bytes,
                                first,
                                now,
                                (op.window.next - op.window.acked) * self.chunk_bytes,
                            )
                        self._cv.notify_all()
                    elif op is not None and f.kind is p.Kind.NACK:
                        op.window.nack(f.chunk)
                        self._cv.notify_all()
        except _NET_ERRORS as e:
            with self._cv:
                self._path_failed(path, sock, f"acknowledgements stopped: {e}")

    # -- the prober ----------------------------------------------------------------------------

    def _probe_loop(self) -> None:
        last = [0.0, 0.0]
        first = True
        while True:
            with self._cv:
                if self._closed:
                    return
                down = [i for i in (0, 1) if self._out[i] is None]
            for path in down:
                now = time.monotonic()
                if not first and now - last[path] < self._probe_s:
                    continue
                last[path] = now
                hello = {"ring": self.ring_id, "rank": self.rank, "path": path}
                try:
                    sock = dial(
                        self._succ_addrs.path(path),
                        self._secret,
                        hello,
                        self.stall_s,
                        timeout_s=2.0 if first else max(2 * self.stall_s, 1.0),
                        buffer=self._buffer,
                    )
                except (OSError, AuthError, ValueError) as e:
                    log.debug("ICCL path %d to rank %d not answering: %s", path, self.succ, e)
                    continue
                with self._cv:
                    if self._closed:
                        shut(sock)
                        return
                    self._out[path] = sock
                    self.paths.restored(path, time.time())
                    self.watch.event(path, "up")
                    self._cv.notify_all()
                threading.Thread(target=self._guard_ack(path, sock), name="unbroken-iccl-ack", daemon=True).start()
            first = False
            time.sleep(min(0.05, self._probe_s))

    def _guard_ack(self, path: int, sock: socket.socket) -> Callable[[], None]:
        return self._guard(lambda: self._ack_loop(path, sock))

    # -- the receiver --------------------------------------------------------------------------

    def _inbound(self, path: int, rank: int, ring: str, sock: socket.socket) -> None:
        if rank != self.pred or ring != self.ring_id:
            log.warning(
                "refused an ICCL connection from rank %s of ring %r (expected rank %d of %r)",
                rank,
                ring,
                self.pred,
                self.ring_id,
            )
            sock.close()
            return
        set_recv_timeout(sock, POLL_S)  # see read_inbound
        with self._cv:
            old, self._in[path] = self._in[path], sock
            if self._closed:
                self._in[path] = None
                old = sock
            self._cv.notify_all()
        if old is not None:
            shut(old)

    def _recv_loop(self) -> None:
        header = bytearray(p.HEADER_BYTES)
        hview = memoryview(header)
        while True:
            with self._cv:
                if self._closed:
                    return
                socks = [(i, s) for i, s in enumerate(self._in) if s is not None]
            if not socks:
                time.sleep(0.02)
                continue
            try:
                ready, _, _ = select.select([s for _, s in socks], [], [], 0.1)
            except (OSError, ValueError):
                continue  # a socket closed under us: take the current ones again
            for path, sock in socks:
                if sock not in ready:
                    continue
                try:
                    self._recv_frame(sock, path, header, hview)
                except _NET_ERRORS as e:
                    log.info("ICCL inbound %s connection from rank %d dropped: %s", p.PATH_NAMES[path], self.pred, e)
                    with self._cv:
                        if self._in[path] is sock:
                            self._in[path] = None
                    shut(sock)
                    self._ack_again(1 - path)
                break  # the set of sockets may have changed

    def _read(self, sock: socket.socket, path: int, view: memoryview) -> None:
        read_inbound(sock, view, lambda: self._in[1 - path], max(2 * self.stall_s, 1.0))

    def _recv_frame(self, sock: socket.socket, path: int, header: bytearray, hview: memoryview) -> None:
        seq = self._rseq
        self._read(sock, path, hview)
        f = p.unpack(header, self.chunk_bytes)
        if f.kind is not p.Kind.DATA:
            raise p.ProtocolError(f"a {f.kind.name} frame on a data connection")
        if p.seq_before(f.seq, seq):  # a resend of a collective already complete here
            self._drain(sock, path, f.nbytes)
            self._reply(sock, p.Kind.ACK, path, f.seq, p.ALL_CHUNKS)
            return
        if f.seq != seq:
            raise p.ProtocolError(f"collective {f.seq} arrived while {seq} is not complete")
        with self._cv:
            while (op := self._ops.get(seq)) is None:  # the peer is a collective ahead of us
                if self._closed or self._error is not None:
                    raise p.ProtocolError("the ring closed")
                self._cv.wait(0.2)
        cur = op.cursor
        verdict = cur.classify(f.chunk)
        if verdict is p.Verdict.DUPLICATE:
            self._drain(sock, path, f.nbytes)
            self._reply(sock, p.Kind.ACK, path, seq, cur.expected)
            return
        if verdict is p.Verdict.AHEAD:
            self._drain(sock, path, f.nbytes)
            if cur.nack_ahead():
                self._reply(sock, p.Kind.NACK, path, seq, cur.expected)
            return
        a, b, reduce = op.sched.recv_item(f.chunk)
        n = (b - a) * op.esize
        if f.nbytes != n:
            raise p.ProtocolError(f"chunk {f.chunk} of collective {seq} has {f.nbytes} bytes; {n} expected")
        dest = self._scratch_raw[:n] if reduce else op.raw[a * op.esize : b * op.esize]
        self._read(sock, path, dest)
        pcrc = p.crc_of(dest)
        if not p.payload_ok(f, header, pcrc):
            cur.corrupted()
            self.corrupt_chunks += 1
            PATH_LOG.corrupt_chunks += 1
            self._reply(sock, p.Kind.NACK, path, seq, cur.expected)
            return
        if reduce:
            op.tensor[a:b].add_(self._scratch[:n].view(op.tensor.dtype))
        else:
            op.fwd_crc[f.chunk] = pcrc
        # Accepted (summed) before anything can fail: a chunk added is never taken again. Then
        # acknowledged before the collective can finish here: a member that then closes its
        # ring leaves no predecessor waiting for an acknowledgement.
        with self._cv:
            cur.accepted()
            self._cv.notify_all()
        try:
            if cur.done or cur.expected % ACK_EVERY == 0:
                self._reply(sock, p.Kind.ACK, path, seq, cur.expected)
        finally:
            if cur.done:
                with self._cv:
                    self._rseq = seq + 1
                    op.recv_done = True
                    self._maybe_finish(op)
                    self._cv.notify_all()

    def _ack_again(self, path: int) -> None:
        """After the other inbound path broke: its last acknowledgements may be lost with it (the
        chunks arrived, the ACKs did not; the sender, with nothing unacknowledged in TCP, would
        never notice), so they are repeated on ``path``, which the sender also reads."""
        sock = self._in[path]
        if sock is None:
            return
        with self._cv:
            seq = self._rseq
            op = self._ops.get(seq)
            upto = op.cursor.expected if op is not None else 0
        try:
            self._reply(sock, p.Kind.ACK, path, seq - 1, p.ALL_CHUNKS)
            if upto:
                self._reply(sock, p.Kind.ACK, path, seq, upto)
        except OSError:
            pass  # that path is going too: the sender's own failure detection takes over

    def _reply(self, sock: socket.socket, kind: p.Kind, path: int, seq: int, chunk: int) -> None:
        sock.sendall(p.pack(kind, path, seq, chunk, 0))

    def _drain(self, sock: socket.socket, path: int, n: int) -> None:
        view = memoryview(self._discard)
        while n > 0:
            k = min(n, len(view))
            self._read(sock, path, view[:k])
            n -= k


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12 only
