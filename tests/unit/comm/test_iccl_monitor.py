"""The window monitor on an ICCL connection, and the process's bounded path log."""

from __future__ import annotations

from unbroken.comm.iccl.monitor import PATH_LOG, LinkWatch, PathLog
from unbroken.comm.iccl.protocol import HopPaths


def test_a_connection_whose_throughput_halves_while_data_waits_is_flagged_and_logged() -> None:
    w = LinkWatch("h1/198.18.0.11", ("eth0", "eth1"), peer=2)
    _, seen = PATH_LOG.since(PATH_LOG.count)
    t = 0.0
    for _ in range(20):  # 1 MB per ms, little waiting
        w.acked(0, 1 << 20, t, t + 0.001, 1 << 20)
        t += 0.001
    assert not w.monitors[0].flagged
    for i in range(10):  # 1 MB per 10 ms, and more and more outstanding
        w.acked(0, 1 << 20, t, t + 0.01, (4 + 4 * i) << 20)
        t += 0.01
    assert w.monitors[0].flagged and w.flags[0] == 1
    new, _ = PATH_LOG.since(seen)
    assert [(e["what"], e["interface"], e["peer"]) for e in new] == [("flagged", "eth0", 2)]
    paths = HopPaths()
    paths.restored(0, 0.0)
    rows = w.stats(paths)
    assert rows[0]["flagged"] and rows[0]["bytes_acked"] == 30 << 20 and not rows[1]["flagged"]


def test_idle_time_between_collectives_is_not_slowness() -> None:
    w = LinkWatch("h", ("eth0", "eth1"), peer=1)
    t = 0.0
    for _step in range(30):
        for _ in range(4):
            w.acked(0, 1 << 20, t, t + 0.001, 1 << 20)
            t += 0.001
        t += 1.0  # the training step computes: nothing in flight
    assert not w.monitors[0].flagged


def test_the_path_log_is_bounded_and_readers_take_what_is_new() -> None:
    log = PathLog(capacity=4)
    for i in range(10):
        log.add({"i": i})
    new, n = log.since(0)
    assert [e["i"] for e in new] == [6, 7, 8, 9] and n == 10
    log.add({"i": 10})
    assert log.since(n) == ([{"i": 10}], 11)
