"""The ICCL ring over real, authenticated loopback connections (primary 127.0.0.1, backup 127.0.0.2).

Members are threads of this process, each with its own sockets and threads, as separate
processes would have; the faults are real socket failures (a connection shut down mid-collective,
bytes altered on their way out), not mocks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from unbroken.comm.iccl import IcclRing, Listener, RingBroken
from unbroken.wire.auth import REFUSE, JobSecret

SECRET = JobSecret(b"s" * 32)
HOSTS = ("127.0.0.1", "127.0.0.2")


@contextlib.contextmanager
def rings(
    n: int,
    faults: dict[int, object] | None = None,
    before: Callable[[list[Listener]], None] | None = None,
    **kw: object,
) -> Iterator[list[IcclRing]]:
    listeners = [Listener(SECRET, HOSTS) for _ in range(n)]
    if before is not None:
        before(listeners)  # between the listeners and the ring (what a stranger may do)
    peers = [x.addrs for x in listeners]
    out: list[IcclRing | None] = [None] * n
    errors: list[BaseException] = []

    def make(r: int) -> None:
        try:
            out[r] = IcclRing(
                SECRET,
                r,
                n,
                listeners[r],
                peers,
                ring_id="t",
                fault=(faults or {}).get(r),
                **kw,  # type: ignore[arg-type]
            )
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert not errors, errors
        yield [r for r in out if r is not None]
    finally:
        for r in out:
            if r is not None:
                r.close(wait_s=2.0)
        for x in listeners:
            x.close()


def inputs(n: int, numel: int, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], torch.Tensor]:
    ts = [torch.arange(numel, dtype=torch.float64).remainder(97).add(r * 0.5).to(dtype) for r in range(n)]
    expected = torch.stack([t.to(torch.float64) for t in ts]).sum(0)
    return ts, expected


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_member_gets_the_sum(n: int) -> None:
    with rings(n, chunk_bytes=4096) as rs:
        ts, expected = inputs(n, 10_001)
        works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
        for w in works:
            w.wait(30)
        for t in ts:
            assert torch.equal(t.to(torch.float64), expected)


def test_collectives_started_back_to_back_complete_in_order_with_any_dtype() -> None:
    with rings(3, chunk_bytes=1024) as rs:
        batches = [
            inputs(3, numel, dtype)
            for numel, dtype in ((5000, torch.float64), (7, torch.bfloat16), (0, torch.float32), (3000, torch.int64))
        ]
        works = [[r.start(ts[i]) for i, r in enumerate(rs)] for ts, _ in batches]  # all in flight at once
        for ws in works:
            for w in ws:
                w.wait(30)
        for ts, expected in batches:
            for t in ts:
                assert torch.equal(t.to(torch.float64), expected.to(t.dtype).to(torch.float64))


class Corrupt:
    """Flips a byte of every other chunk sent, ``limit`` times."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count, self.n = limit, 0, 0

    def payload(self, seq: int, chunk: int, path: int, data: memoryview) -> memoryview | bytes:
        self.n += 1
        if self.count >= self.limit or self.n % 2 or not len(data):
            return data
        self.count += 1
        bad = bytearray(data)
        bad[0] ^= 0x01
        return bytes(bad)


def test_a_corrupted_chunk_is_resent_never_summed() -> None:
    fault = Corrupt(limit=40)
    with rings(3, faults={1: fault}, chunk_bytes=2048) as rs:
        for _ in range(4):
            ts, expected = inputs(3, 20_000)
            works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
            for w in works:
                w.wait(30)
            for t in ts:
                assert torch.equal(t.to(torch.float64), expected)  # bitwise: every member the same
        assert fault.count == 40
        assert rs[2].corrupt_chunks > 0  # rank 1's successor caught them


def test_a_primary_that_dies_mid_collective_moves_the_hop_to_the_backup_and_back() -> None:
    with rings(3, chunk_bytes=4096, window_chunks=4, probe_s=0.1) as rs:
        ts, expected = inputs(3, 400_000)
        works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
        time.sleep(0.005)
        sock = rs[0]._out[0]
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)  # rank 0's primary connection fails in flight
        for w in works:
            w.wait(30)
        for t in ts:
            assert torch.equal(t.to(torch.float64), expected)
        assert rs[0].paths.failovers == 1
        deadline = time.monotonic() + 10
        while rs[0].paths.failbacks == 0 and time.monotonic() < deadline:  # the redial answers
            ts, expected = inputs(3, 50_000)
            for w in [r.start(t) for r, t in zip(rs, ts, strict=True)]:
                w.wait(30)
            for t in ts:
                assert torch.equal(t.to(torch.float64), expected)
        assert rs[0].paths.failbacks == 1 and rs[0].paths.active == 0
        verdicts = rs[0].watch.verdicts()
        assert [(v["state"], v["interface"], v["peer"]) for v in verdicts] == [("failing", "primary", 1)]


def test_losing_both_paths_fails_the_collective_instead_of_hanging() -> None:
    with rings(2, chunk_bytes=4096, probe_s=30.0) as rs:
        ts, _ = inputs(2, 200_000)
        works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
        for s in list(rs[0]._out):
            if s is not None:
                s.shutdown(socket.SHUT_RDWR)
        with pytest.raises(RingBroken, match="both paths"):
            works[0].wait(20)
        assert rs[0].start(ts[0]).exception() is not None  # the ring stays broken


def test_close_fails_what_is_pending() -> None:
    with rings(2) as rs:
        ts, _ = inputs(2, 1000)
        w = rs[0].start(ts[0])  # rank 1 never starts its part
        rs[0].close()
        with pytest.raises(RingBroken, match="closed"):
            w.wait(5)


def test_connections_without_the_secret_are_refused() -> None:
    with rings(2) as rs:
        listener = rs[1]._listener
        with socket.create_connection(listener.addrs.primary.rsplit(":", 1)) as s:  # type: ignore[arg-type]
            s.settimeout(5)
            s.sendall(b"\x00" * 48)  # a wrong ticket (a client speaks first: unbroken.wire.auth)
            got = b""
            with contextlib.suppress(ConnectionResetError):  # closed with our extra bytes unread
                while chunk := s.recv(64):
                    got += chunk
            assert got in (b"", REFUSE)  # refused and closed, nothing else said
        ts, expected = inputs(2, 3000)
        for w in [r.start(t) for r, t in zip(rs, ts, strict=True)]:
            w.wait(30)
        assert torch.equal(ts[0].to(torch.float64), expected)
        assert listener.refused == 1


def test_bad_input_gets_a_clear_error() -> None:
    with rings(2) as rs:
        with pytest.raises(ValueError, match="contiguous CPU"):
            rs[0].start(torch.zeros(4, 4).t())
    listener = Listener(SECRET, HOSTS)
    try:
        with pytest.raises(ValueError, match="size >= 2"):
            IcclRing(SECRET, 0, 1, listener, [])
    finally:
        listener.close()


def test_a_chunk_is_never_summed_twice_across_failovers() -> None:
    """Regression: an acknowledgement that fails on the dying path must not leave a chunk summed
    but not accepted (its resend on the backup was then summed again: wrong on every member)."""
    for _ in range(4):
        with rings(3, chunk_bytes=4096, window_chunks=4, probe_s=0.1) as rs:
            ts, expected = inputs(3, 300_000)
            works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
            time.sleep(0.003)
            sock = rs[0]._out[0]
            assert sock is not None
            sock.shutdown(socket.SHUT_RDWR)
            for w in works:
                w.wait(30)
            for t in ts:
                assert torch.equal(t.to(torch.float64), expected)


def test_rings_built_and_closed_epoch_after_epoch_leave_no_thread_or_socket_behind() -> None:
    before = threading.active_count()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with rings(2, chunk_bytes=4096) as rs:
            ts, _ = inputs(2, 10_000)
            for w in [r.start(t) for r, t in zip(rs, ts, strict=True)]:
                w.wait(30)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_strangers_sockets_on_every_listener_neither_stop_a_ring_forming_nor_failing_over() -> None:
    """Before the gate, four idle connections took every handshake slot of a listener for the
    handshake's 10 s: a ring could not form, nor a member redial its backup."""
    strangers: list[socket.socket] = []

    def flood(listeners: list[Listener]) -> None:
        for listener in listeners:
            for addr in (listener.addrs.primary, listener.addrs.backup):
                host, port = addr.rsplit(":", 1)
                for i in range(12):
                    s = socket.create_connection((host, int(port)))
                    if i % 3 == 1:
                        s.sendall(b"GET / HTTP/1.1\r\n")  # garbage, short of a ticket: waits
                    elif i % 3 == 2:
                        s.sendall(os.urandom(48))  # a wrong ticket: refused
                    strangers.append(s)

    began = time.monotonic()
    try:
        with rings(3, before=flood, chunk_bytes=4096, window_chunks=4, probe_s=0.1) as rs:
            formed = time.monotonic() - began
            ts, expected = inputs(3, 400_000)
            works = [r.start(t) for r, t in zip(rs, ts, strict=True)]
            time.sleep(0.005)
            sock = rs[0]._out[0]
            assert sock is not None
            sock.shutdown(socket.SHUT_RDWR)  # a failover while the strangers still hold on
            for w in works:
                w.wait(30)
            for t in ts:
                assert torch.equal(t.to(torch.float64), expected)
            assert rs[0].paths.failovers == 1
            took = time.monotonic() - began
            listener = rs[1]._listener
            assert listener.refused >= 8  # the wrong tickets, counted by its gates
            assert sum(g.pending for g in listener.gates) <= 16  # the idle ones, held cheaply
    finally:
        for s in strangers:
            s.close()
    assert formed < 8.0 and took < 15.0, (formed, took)  # without the gate: no ring in 10 s
