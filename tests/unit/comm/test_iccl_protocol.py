"""The ICCL exchange's pure logic: chunk schedule, frames, acks and resends, failover."""

from __future__ import annotations

import pytest

from unbroken.comm.iccl import protocol as p


def simulate_ring(values: list[list[float]], chunk_elems: int) -> list[list[float]]:
    """Runs the schedule of every member step by step on plain lists: what the sockets carry."""
    n, numel = len(values), len(values[0])
    data = [list(v) for v in values]
    scheds = [p.RingSchedule(numel, n, r, chunk_elems) for r in range(n)]
    total = scheds[0].total
    for i in range(total):
        # Chunk i is sent by every member at once: what each sends is read before anyone writes.
        sent = [data[r][slice(*scheds[r].send_item(i))] for r in range(n)]
        for r in range(n):
            a, b, reduce = scheds[r].recv_item(i)
            got = sent[(r - 1) % n]
            assert len(got) == b - a
            data[r][a:b] = [x + y for x, y in zip(data[r][a:b], got, strict=True)] if reduce else got
    return data


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("numel,chunk", [(1, 1), (3, 1), (10, 3), (97, 8), (64, 1000)])
def test_the_schedule_sums_every_element_on_every_member(n: int, numel: int, chunk: int) -> None:
    values = [[float((r + 1) * 1000 + i) for i in range(numel)] for r in range(n)]
    expected = [sum(v[i] for v in values) for i in range(numel)]
    assert all(row == expected for row in simulate_ring(values, chunk))


def test_a_chunk_leaves_only_after_the_chunk_it_carries_arrived() -> None:
    s = p.RingSchedule(100, 3, 1, 10)
    c = s.chunks_per_step
    assert c == 4 and s.total == 4 * c
    for i in range(s.total):
        need = s.received_before_send(i)
        if i >= c:
            # What goes out at step k is what came in at step k-1, same element range.
            assert s.send_item(i) == s.recv_item(i - c)[:2] and need == i - c + 1
        else:
            assert need == 0


def test_schedule_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="size >= 2"):
        p.RingSchedule(10, 1, 0, 4)
    with pytest.raises(ValueError, match="chunk_elems"):
        p.RingSchedule(10, 2, 0, 0)


def test_frames_round_trip_and_carry_a_crc_over_payload_and_header() -> None:
    payload = b"x" * 100
    h = p.pack(p.Kind.DATA, 1, 7, 3, len(payload), p.crc_of(payload))
    f = p.unpack(h, 1000)
    assert (f.kind, f.path, f.seq, f.chunk, f.nbytes) == (p.Kind.DATA, 1, 7, 3, 100)
    assert p.payload_ok(f, h, p.crc_of(payload))
    assert not p.payload_ok(f, h, p.crc_of(b"y" + payload[1:]))
    bad = bytearray(h)
    bad[8] ^= 1  # the chunk index altered on the wire
    assert not p.payload_ok(p.unpack(bad, 1000), bad, p.crc_of(payload))


def test_untrusted_headers_are_refused() -> None:
    with pytest.raises(p.ProtocolError, match="at most"):
        p.unpack(p.pack(p.Kind.DATA, 0, 0, 0, 5000), 1000)
    ack = bytearray(p.pack(p.Kind.ACK, 0, 1, 2, 0))
    ack[10] ^= 4
    with pytest.raises(p.ProtocolError, match="corrupt ACK"):
        p.unpack(ack, 0)
    junk = bytearray(p.HEADER_BYTES)
    junk[0] = 9
    with pytest.raises(p.ProtocolError, match="unknown kind"):
        p.unpack(junk, 0)


def test_sequence_numbers_wrap() -> None:
    assert p.seq_before(1, 2) and not p.seq_before(2, 1) and not p.seq_before(3, 3)
    assert p.seq_before(p.SEQ_MOD - 1, 0)


def test_send_window_bounds_what_is_in_flight_and_resends_after_a_nack() -> None:
    w = p.SendWindow(total=10, window=3)
    assert [w.sent() for _ in range(3)] == [0, 1, 2]
    assert not w.can_send()
    assert w.ack(2) and w.acked == 2 and w.can_send()
    w.sent()
    w.sent()  # 3, 4 in flight with 2
    w.nack(3)  # chunk 3 arrived corrupt: go back to it
    assert w.next == 3 and w.sent() == 3 and w.resent == 1
    w.nack(1)  # stale: 1 was acknowledged since
    assert w.next == 4
    with pytest.raises(p.ProtocolError, match="acknowledged 9"):
        w.ack(9)
    assert not w.ack(1)  # old news


def test_send_window_rewinds_to_the_first_unacknowledged_chunk_on_failover() -> None:
    w = p.SendWindow(total=5, window=8)
    for _ in range(5):
        w.sent()
    w.ack(2)
    w.rewind()
    assert w.next == 2 and not w.done
    assert [w.sent() for _ in range(3)] == [2, 3, 4] and w.resent == 3
    assert w.ack(p.ALL_CHUNKS) and w.done and w.quiet


def test_receiver_accepts_in_order_and_nacks_once_per_gap() -> None:
    c = p.RecvCursor(total=4)
    assert c.classify(0) is p.Verdict.ACCEPT
    c.accepted()
    assert c.classify(0) is p.Verdict.DUPLICATE
    assert c.classify(2) is p.Verdict.AHEAD and c.nack_ahead() and not c.nack_ahead()
    c.corrupted()  # chunk 1 arrived corrupt: NACKed already, no NACK for the frames behind it
    assert not c.nack_ahead() and c.corrupt == 1
    c.accepted()
    assert c.nack_ahead()  # a new gap
    with pytest.raises(p.ProtocolError):
        c.classify(4)


def test_hop_fails_over_to_the_backup_and_back_when_the_primary_answers() -> None:
    h = p.HopPaths()
    h.restored(p.PRIMARY, 0.0)
    h.restored(p.BACKUP, 0.0)
    assert h.active == p.PRIMARY
    assert h.failed(p.PRIMARY, 1.0, "link down")
    assert h.active == p.BACKUP and h.failovers == 1 and not h.want_failback()
    h.failed(p.PRIMARY, 1.1, "again")  # idempotent while down
    assert h.downs[p.PRIMARY] == 1
    h.restored(p.PRIMARY, 2.0)
    assert h.want_failback()
    h.failback(2.0)
    assert h.active == p.PRIMARY and h.failbacks == 1
    assert [e.what for e in h.events] == ["up", "up", "down", "failover", "up", "failback"]


def test_hop_with_both_paths_gone_cannot_go_on() -> None:
    h = p.HopPaths()
    h.restored(p.PRIMARY, 0.0)
    h.restored(p.BACKUP, 0.0)
    assert h.failed(p.BACKUP, 1.0, "standby lost")  # the active primary still works
    assert h.active == p.PRIMARY
    assert not h.failed(p.PRIMARY, 2.0, "link down")
    assert not h.alive


def test_hop_events_are_bounded() -> None:
    h = p.HopPaths()
    for i in range(1000):
        h.restored(p.PRIMARY, float(i))
        h.failed(p.PRIMARY, float(i), "flap")
    assert len(h.events) == p.HopPaths.MAX_EVENTS
