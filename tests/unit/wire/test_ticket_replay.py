"""A ticket seen on the wire cannot be replayed: each is taken once, within a window of its time.

A ticket only admits a connection to the handshake (whose proofs over the listener's fresh nonce
a replay fails), but an admitted connection takes a key holder's slot and a thread for the
handshake's timeout: replayed without end, one ticket once shut the job's own processes out.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from tests.live_coordinator import connect, live_coordinator
from unbroken.comm.iccl import Listener
from unbroken.wire.auth import (
    ACCEPT,
    REFUSE,
    TICKET_WINDOW_S,
    AuthError,
    JobSecret,
    TicketLedger,
    make_ticket,
)
from unbroken.wire.store import StoreServer

SECRET = JobSecret(b"r" * 32)


def answer(address: str, first: bytes) -> bytes:
    """The listener's first byte to a connection that sends ``first``."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(first)
        return s.recv(1)


def test_a_replayed_ticket_is_refused_by_a_gated_listener() -> None:
    store = StoreServer("127.0.0.1", SECRET)
    try:
        ticket, _ = make_ticket(SECRET, "store")
        assert answer(store.address, ticket) == ACCEPT  # the key holder's connection
        refused = store.gate.refused
        for _ in range(3):
            assert answer(store.address, ticket) == REFUSE  # the same bytes, replayed
        assert store.gate.refused == refused + 3
        assert answer(store.address, make_ticket(SECRET, "store")[0]) == ACCEPT  # a fresh one still works
    finally:
        store.close()


def test_a_replayed_ticket_is_refused_by_an_iccl_listener() -> None:
    listener = Listener(SECRET, ("127.0.0.1", "127.0.0.1"))
    try:
        ticket, _ = make_ticket(SECRET, "iccl")
        assert answer(listener.addrs.primary, ticket) == ACCEPT
        assert answer(listener.addrs.backup, ticket) == REFUSE  # nor on the other path
    finally:
        listener.close()


def test_a_replayed_ticket_is_refused_by_the_coordinator(tmp_path: Path) -> None:
    async def scenario() -> tuple[bytes, bytes, bytes]:
        async with live_coordinator(tmp_path, SECRET) as c:
            ticket, _ = make_ticket(SECRET, "coordinator")
            first = await asyncio.to_thread(answer, c.address, ticket)
            replayed = await asyncio.to_thread(answer, c.address, ticket)
            link = await connect(c, SECRET)  # a key holder's fresh connection is served
            link.writer.close()
            stale, _ = make_ticket(SECRET, "coordinator", now=time.time() - TICKET_WINDOW_S - 60)
            return first, replayed, await asyncio.to_thread(answer, c.address, stale)

    assert asyncio.run(scenario()) == (ACCEPT, REFUSE, REFUSE)


def test_a_ledger_takes_each_ticket_once_within_its_window() -> None:
    now = [1_000_000.0]
    ledger = TicketLedger(window_s=300, capacity=1000, clock=lambda: now[0])
    ledger.take(b"a" * 16, now[0], "store")
    with pytest.raises(AuthError, match="replayed"):
        ledger.take(b"a" * 16, now[0], "store")
    with pytest.raises(AuthError, match=r"-301 s from this machine's time.*differ by more than 300 s"):
        ledger.take(b"b" * 16, now[0] - 301, "store")
    with pytest.raises(AuthError, match=r"\+301 s"):
        ledger.take(b"c" * 16, now[0] + 301, "store")
    ledger.take(b"d" * 16, now[0] - 299, "store")  # skewed clocks within the window
    now[0] += 301
    with pytest.raises(AuthError, match="from this machine's time"):  # too old now: still refused
        ledger.take(b"a" * 16, now[0] - 301, "store")
    ledger.take(b"e" * 16, now[0], "store")
    assert len(ledger) == 1  # what left the window is forgotten


def test_a_full_ledger_forgets_its_oldest_and_refuses_what_is_older() -> None:
    now = 1_000_000.0
    ledger = TicketLedger(window_s=300, capacity=100, clock=lambda: now)
    for i in range(250):
        ledger.take(i.to_bytes(16, "big"), now - 250 + i, "coordinator")
        assert len(ledger) <= 100
    for i in (0, 149):  # forgotten, and issued no later than the newest forgotten: refused
        with pytest.raises(AuthError, match="older than the 100 it remembers"):
            ledger.take(i.to_bytes(16, "big"), now - 250 + i, "coordinator")
    with pytest.raises(AuthError, match="replayed"):
        ledger.take((200).to_bytes(16, "big"), now - 50, "coordinator")
    ledger.take(b"new" + bytes(13), now, "coordinator")
