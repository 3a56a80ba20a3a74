"""The pure diagnosis rules on synthesized traces."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.diagnosis.robust import learned_threshold, robust_z
from unbroken.diagnosis.rules import hang, links, straggler
from unbroken.diagnosis.rules.metrics import MetricDetector, parse_policy, wants_skip
from unbroken.diagnosis.rules.window import WindowMonitor
from unbroken.diagnosis.verdict import COMM_HANG, NONCOMM_HANG, Culprit, Verdict


def view(
    replica: int, entered: int, wait: float | None, silent: float = 0.1, opens=(), furthest=None, done=None
) -> hang.RankView:
    """A rank not waiting (``wait`` None) completed what it entered, unless ``done`` says otherwise."""
    furthest = max((o.step for o in opens), default=None) if furthest is None else furthest
    done = (entered if wait is None else entered - 1) if done is None else done
    return hang.RankView(replica, 0, f"n{replica}", entered, wait, silent, tuple(opens), furthest, done)


def test_lagging_counter_is_a_noncomm_hang_of_that_rank() -> None:
    views = [view(0, 7, 1.0), view(1, 6, None), view(2, 7, 1.0)]
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == NONCOMM_HANG and f.culprit.replica == 1


def test_a_lagging_rank_waiting_on_the_ring_is_not_a_noncomm_hang() -> None:
    # Replica 0 is still in seq 6 with a receive open (its peers' data is late on a lossy
    # link) while 1 and 2 wait at seq 7: it is in communication, not stuck outside it.
    views = [view(0, 6, 1.0, opens=[hang.OpenTransfer(2, 3, 0.9)]), view(1, 7, 1.0), view(2, 7, 1.0)]
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None
    # Stopped in there (its telemetry silent) it is named all the same; so is a lagger outside.
    views[0] = view(0, 6, 1.0, silent=1.5, opens=[hang.OpenTransfer(2, 3, 0.9)])
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == NONCOMM_HANG and f.culprit.replica == 0
    views[0] = view(0, 6, None)
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == NONCOMM_HANG and f.culprit.replica == 0


def test_short_waits_are_not_hangs() -> None:
    views = [view(0, 7, 0.2), view(1, 6, None), view(2, 7, 0.2)]
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None


def test_silent_rank_inside_the_collective_is_its_fault() -> None:
    views = [view(0, 7, 1.0), view(1, 7, 1.0, silent=1.5), view(2, 7, 1.0)]
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == NONCOMM_HANG and f.culprit.replica == 1


def test_equal_counters_earliest_stalled_transfer_names_the_link() -> None:
    # stall on 0 -> 1 at ring step 1; the later stalls downstream are consequences
    views = [
        view(0, 7, 1.0, opens=[hang.OpenTransfer(2, 3, 0.8)]),
        view(1, 7, 1.0, opens=[hang.OpenTransfer(0, 1, 0.95)]),
        view(2, 7, 1.0, opens=[hang.OpenTransfer(1, 2, 0.9)]),
    ]
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == COMM_HANG and f.culprit.link == (0, 1)


def test_a_stall_downstream_of_a_sender_still_at_an_earlier_step_names_nobody_yet() -> None:
    # 2 waits on 1 -> 2 at ring step 1, but 1 has shown nothing past step 0 (its own wait on
    # 0 -> 1 at step 0 is not in its telemetry yet): 1 -> 2 is a consequence, not the fault.
    views = [
        view(0, 7, 0.7, furthest=0),
        view(1, 7, 0.7, furthest=0),
        view(2, 7, 0.7, opens=[hang.OpenTransfer(1, 1, 0.55)]),
    ]
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None
    views[1] = view(1, 7, 0.7)  # nothing open reported at all: no evidence either
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None
    # Nor when its telemetry says it is between collectives but it never completed seq 7.
    views[1] = view(1, 7, None, done=6)
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None
    # Once 1's telemetry shows its open receive from 0 at step 0, the link 0 -> 1 is named.
    views[1] = view(1, 7, 0.7, opens=[hang.OpenTransfer(0, 0, 0.6)])
    f = hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == COMM_HANG and f.culprit.link == (0, 1)


def test_comm_hang_without_connection_timings_names_no_replica() -> None:
    views = [view(0, 7, 1.0), view(1, 7, 1.0)]
    f = hang.classify_hang("g", views, 0.5, 1.0)
    assert f is not None and f.kind == COMM_HANG and f.culprit.replica == -1 and f.confidence < 0.5


def test_a_rank_still_waiting_in_a_collective_its_peers_completed_names_nobody() -> None:
    # A busy host has not run replica 0 since its data came: its peers are done with seq 1.
    views = [view(0, 1, 0.7), view(1, 1, None), view(2, 1, None)]
    assert hang.classify_hang("g", views, hang_s=0.6, silent_s=1.0) is None
    # ... unless a transfer timing names the missing data (the ring's open receives).
    views[0] = view(0, 1, 0.7, opens=[hang.OpenTransfer(2, 1, 0.7)])
    f = hang.classify_hang("g", views, hang_s=0.6, silent_s=1.0)
    assert f is not None and f.kind == COMM_HANG and f.culprit.link == (2, 0)


def test_a_collective_the_last_rank_only_just_entered_is_not_hung() -> None:
    # a newcomer's cold first step: the others waited for it, the collective itself is young
    views = [view(0, 0, 2.6), view(1, 0, 0.1), view(2, 0, 2.7)]
    assert hang.classify_hang("g", views, hang_s=0.5, silent_s=1.0) is None
    later = [view(0, 0, 3.2), view(1, 0, 0.7), view(2, 0, 3.3)]
    f = hang.classify_hang("g", later, hang_s=0.5, silent_s=1.0)
    assert f is not None and f.kind == COMM_HANG


def test_straggler_needs_slow_and_last() -> None:
    rng = random.Random(0)
    comp = {r: [0.1 * (1.5 if r == 2 else 1.0) * rng.uniform(0.95, 1.05) for _ in range(10)] for r in range(3)}
    was_fast = {0: 0.1, 1: 0.1, 2: 0.1}  # replica 2 became 1.5x slower
    f = straggler.find_straggler(comp, [2] * 10, was_fast)
    assert f is not None and f.replica == 2 and f.relative < 0.75
    assert straggler.find_straggler(comp, [0, 1] * 5, was_fast) is None  # slow but not last: noise


def test_always_slow_rank_is_named_only_when_far_behind() -> None:
    # Three processes on two cores: one is 1.5x slower from the first step to the last.
    rng = random.Random(3)
    comp = {r: [0.1 * (1.5 if r == 2 else 1.0) * rng.uniform(0.98, 1.02) for _ in range(10)] for r in range(3)}
    always = {0: 0.1, 1: 0.1, 2: 0.15}
    assert straggler.find_straggler(comp, [2] * 10, always) is None
    far = {r: [x * (2 if r == 2 else 1) for x in xs] for r, xs in comp.items()}  # now 3x: a real straggler
    f = straggler.find_straggler(far, [2] * 10, always)
    assert f is not None and f.replica == 2


def test_even_noise_is_no_straggler() -> None:
    rng = random.Random(1)
    comp = {r: [rng.uniform(0.05, 0.2) for _ in range(10)] for r in range(3)}
    assert straggler.find_straggler(comp, [rng.randrange(3) for _ in range(10)], {}) is None


def cells(slow: set[tuple[int, int]], factor: float = 4.0, n: int = 3) -> dict:
    rng = random.Random(2)
    return {
        (a, b): [0.01 * (factor if (a, b) in slow else 1.0) * rng.uniform(0.9, 1.1) for _ in range(8)]
        for a in range(n)
        for b in range(n)
        if a != b
    }


@pytest.mark.parametrize(
    ("slow", "factor", "pattern", "culprit", "link"),
    [
        ({(0, 1), (1, 0)}, 4.0, "link", 0, (0, 1)),
        ({(1, 2)}, 8.0, "link", 1, (1, 2)),  # one direction 8x: the link's sum is 4.5x
        ({(2, 0), (2, 1), (0, 2), (1, 2)}, 4.0, "node", 2, None),
    ],
)
def test_connection_matrix_patterns(slow, factor, pattern, culprit, link) -> None:
    f = links.classify_slow(cells(slow, factor))
    assert f is not None and f.pattern == pattern
    assert (f.replica, f.link) == (culprit, link)


def test_one_direction_slowed_a_little_is_not_enough() -> None:
    """A link is judged by both directions: one 4x slower than the rest is a 2.5x link at most,
    within what a busy host's noise and clock errors may do to it."""
    assert links.classify_slow(cells({(1, 2)}, 4.0)) is None


def test_slow_row_or_column_names_the_node() -> None:
    """Sender and receiver cannot be told apart (each direction carries a clock error, only the
    link's sum is exact): a slow row or column is that member's node."""
    row = links.classify_slow(cells({(3, b) for b in range(4) if b != 3}, 8.0, n=4))
    col = links.classify_slow(cells({(a, 1) for a in range(4) if a != 1}, 8.0, n=4))
    assert row is not None and (row.pattern, row.replica) == ("node", 3)
    assert col is not None and (col.pattern, col.replica) == ("node", 1)


def test_opposite_clock_errors_on_a_link_cancel() -> None:
    """Replica 2's clock mapped 0.5 ms/MB late: its incoming cells read slow, its outgoing fast."""
    skewed = {
        (a, b): [x + (0.005 if b == 2 else -0.005 if a == 2 else 0.0) for x in xs]
        for (a, b), xs in cells(set()).items()
    }
    assert links.classify_slow(skewed) is None


def transfer(send_post: float, recv_post: float, recv_done: float, queued: float = 0.0) -> links.TransferTimes:
    return links.TransferTimes((0, 0), (1, 0), send_post, recv_post, recv_done, queued, 0.5)


def test_a_late_receiver_is_timed_on_its_own_clock() -> None:
    """It posted 4 ms after the sender: 1 ms from its post to the data, whatever the sender's
    clock says; no pair correction needed."""
    t = transfer(10.000, 20.004, 20.005)  # the receiver's clock runs 10 s ahead
    assert links.transfer_time(t, 10.0, 0.0, None) == pytest.approx(0.002)  # 1 ms over 0.5 MB


def test_an_awaited_transfer_needs_its_pairs_clocks_reconciled() -> None:
    t = transfer(1.000, 0.990, 1.003)
    assert links.transfer_time(t, 0.0, 0.0, None) is None
    assert links.transfer_time(t, 0.0, 0.0, 0.0015) == pytest.approx(0.0015 / 0.5)


def test_a_cpu_wait_before_the_sender_posted_is_not_taken_off() -> None:
    """The receiver posted at 0.990 and was preempted for 8 ms before the sender posted at 1.000:
    that wait cannot have fallen inside the transfer, and nothing comes off."""
    t = transfer(1.000, 0.990, 1.002, queued=0.008)
    assert links.transfer_time(t, 0.0, 0.0, 0.0) == pytest.approx(0.004)
    late = transfer(1.000, 1.001, 1.010, queued=0.006)  # a late receiver's wait is all inside
    assert links.transfer_time(late, 0.0, 0.0, None) == pytest.approx(0.006)


def test_clock_corrections_from_a_pairs_fastest_transfers() -> None:
    """The receiver's clock maps 1.5 ms late: 0.5 ms transfers read 2.0 ms one way, -1.0 ms the
    other; the correction puts both at 0.5 ms, and a late transfer is left as it was."""
    a, b = (0, 0), (1, 0)
    e = 0.0015
    there = [
        links.TransferTimes(a, b, 1.0 + i, 0.99 + i + e, 1.0005 + i + e + 0.001 * (i % 3), 0.0, 1.0) for i in range(5)
    ]
    back = [links.TransferTimes(b, a, 1.0 + i + e, 0.99 + i, 1.0005 + i, 0.0, 1.0) for i in range(5)]
    fix = links.clock_corrections(there + back, {a: 0.0, b: 0.0})
    assert fix[(a, b)] == pytest.approx(e) and fix[(b, a)] == pytest.approx(-e)
    assert links.transfer_time(there[0], 0.0, 0.0, fix[(a, b)]) == pytest.approx(0.0005)
    assert links.transfer_time(back[0], 0.0, 0.0, fix[(b, a)]) == pytest.approx(0.0005)
    assert links.clock_corrections(there, {a: 0.0, b: 0.0}) == {}  # one way only: no estimate


def test_slow_node_known_by_its_outgoing_directions_alone_is_named() -> None:
    """Its incoming cells are short (their pairs' clocks not reconciled yet): its links are
    judged by their outgoing direction alone."""
    got = cells({(1, 0), (1, 2)}, 20.0)
    got[(0, 1)] = got[(0, 1)][:2]
    got[(2, 1)] = got[(2, 1)][:3]
    f = links.classify_slow(got)
    assert f is not None and (f.pattern, f.replica) == ("node", 1)
    assert f.evidence["one_way_scores"].keys() == {"1>0", "1>2"}


def test_a_lone_direction_must_clear_twice_the_bar() -> None:
    """A whole link 2.5x its peers is slow; a direction alone, whose clock error does not
    cancel, must be 5x the healthy directions."""
    got = cells({(1, 2)}, 4.0)
    got[(2, 1)] = got[(2, 1)][:2]
    assert links.classify_slow(got) is None
    got[(1, 2)] = [x * 2 for x in got[(1, 2)]]  # 8x
    f = links.classify_slow(got)
    assert f is not None and (f.pattern, f.link) == ("link", (1, 2))


def test_a_lone_direction_is_never_the_reference() -> None:
    """With no link known both ways there is no scale: no verdict, however uneven the cells."""
    got = {(0, 1): [0.01] * 8, (1, 2): [0.5] * 8, (2, 0): [0.01] * 8}
    assert links.classify_slow(got) is None
    assert links.one_way_scores(got) == {}


def stalled(got: dict, cell: tuple[int, int], n: int, seconds_per_mb: float = 5.0) -> dict:
    got = dict(got)
    got[cell] = [seconds_per_mb] * n + got[cell][n:]
    return got


def test_a_lossy_link_stalls_while_its_floor_stays_healthy() -> None:
    """Two transfers of sixteen waiting out a retransmission (500x a healthy one) on link 1-2:
    its fastest quarter is healthy, so it is not slow, but it stalls."""
    base = {k: v * 2 for k, v in cells(set()).items()}  # 16 samples a cell
    got = stalled(base, (2, 1), 2)
    assert links.classify_slow(got) is None
    f = links.classify_stalling(got)
    assert f is not None and (f.pattern, f.link) == ("link", (1, 2))
    assert f.evidence["stalls"] == {"0-1": 0, "0-2": 0, "1-2": 2}


def test_one_stall_or_a_busy_hosts_tail_is_no_lossy_link() -> None:
    """One stall in a window, or every transfer's tail at 36x the floor (the worst of 11,871
    clean transfers in the box), is not a lossy link."""
    base = {k: v * 2 for k, v in cells(set()).items()}
    assert links.classify_stalling(stalled(base, (2, 1), 1)) is None
    tail = {k: [x * (36.0 if i % 4 == 0 else 1.0) for i, x in enumerate(v)] for k, v in base.items()}
    assert links.classify_stalling(tail) is None


def test_a_node_and_its_own_link_are_the_same_evidence() -> None:
    link12, node1, node0 = ("link", frozenset({1, 2}), "stalling"), ("node", 1, "stalling"), ("node", 0, "stalling")
    assert links.same_evidence(link12, node1) and links.same_evidence(node1, link12)
    assert not links.same_evidence(link12, node0)  # not one of its ends
    assert not links.same_evidence(link12, ("node", 1, "slow"))  # another cause
    assert not links.same_evidence(("link", frozenset({0, 1}), "slow"), ("link", frozenset({1, 2}), "slow"))
    assert links.same_evidence(None, None) and not links.same_evidence(node1, None)


def test_a_lossy_node_stalls_on_all_its_links() -> None:
    base = {k: v * 2 for k, v in cells(set()).items()}
    got = stalled(stalled(base, (0, 1), 2), (2, 1), 3)
    f = links.classify_stalling(got)
    assert f is not None and (f.pattern, f.replica) == ("node", 1)


def test_uniform_matrix_has_no_culprit() -> None:
    assert links.classify_slow(cells(set())) is None


def test_cell_is_judged_by_its_floor_not_its_tail() -> None:
    """Half the transfers of a cell delayed 5x (scheduling) is not a slow wire; all of them is."""
    base = cells(set())
    tail = dict(base)
    for c in ((0, 1), (1, 0)):
        tail[c] = [x * (5.0 if i % 2 else 1.0) for i, x in enumerate(base[c])]
    assert links.classify_slow(tail) is None
    slow = dict(base)
    slow[(0, 1)] = [x * 5.0 for x in base[(0, 1)]]
    slow[(1, 0)] = [x * 5.0 for x in base[(1, 0)]]
    f = links.classify_slow(slow)
    assert f is not None and f.link == (0, 1)


def test_idle_or_short_cells_are_not_judged() -> None:
    few = cells({(0, 1)})
    few[(0, 1)] = few[(0, 1)][:3]  # a connection that carried almost nothing
    assert links.classify_slow(few) is None


@pytest.mark.parametrize("kw", [{"ratio": 1.0}, {"quantile": 1.5}, {"min_samples": 0}])
def test_bad_link_settings_are_refused(kw) -> None:
    with pytest.raises(ValueError, match="ratio"):
        links.classify_slow(cells(set()), **kw)


def test_window_monitor_ignores_idle_and_flags_congestion() -> None:
    m = WindowMonitor(window=4)
    for _ in range(10):
        assert not m.completed(1_000_000, 0.01, outstanding=1_000_000)
    for _ in range(4):  # slow but nothing waiting: idle, not congestion
        assert not m.completed(1_000_000, 0.05, outstanding=0)
    m2 = WindowMonitor(window=4)
    for _ in range(10):
        m2.completed(1_000_000, 0.01, outstanding=1_000_000)
    flagged = [m2.completed(1_000_000, 0.05, outstanding=4_000_000 * 3**i) for i in range(4)]  # data piles up
    assert flagged[-1]
    for _ in range(4):
        m2.completed(1_000_000, 0.01, outstanding=0)
    assert not m2.flagged


def test_metric_detector_nonfinite_spike_and_memory() -> None:
    d = MetricDetector(min_history=16, memory_window=20)
    rng = random.Random(3)
    for s in range(30):
        assert d.observe(s, loss=2.0 + rng.uniform(-0.05, 0.05), grad_norm=1.0 + rng.uniform(-0.1, 0.1)) == []
    assert [a.kind for a in d.observe(30, loss=float("nan"))] == ["nonfinite_loss"]
    assert [a.kind for a in d.observe(31, loss=9.0)] == ["loss_spike"]
    assert [a.kind for a in d.observe(32, grad_norm=50.0)] == ["grad_explosion"]
    kinds = [a.kind for s in range(20) for a in d.observe(40 + s, memory=1e9 * (1 + 0.02 * s))]
    assert "memory_growth" in kinds
    flat = MetricDetector(memory_window=20)
    assert not any(flat.observe(s, memory=1e9 + rng.uniform(0, 1e6)) for s in range(40))


def test_step_time_change_point() -> None:
    d = MetricDetector(min_history=16, change_window=8)
    for s in range(24):
        d.observe(s, compute_s=0.1)
    assert d.change_point() == pytest.approx(1.0)
    # 1.4x is below the measured threshold (STEP_TIME_THRESHOLD 1.45): silent; 1.6x is named.
    assert not any(a for s in range(8) for a in d.observe(24 + s, compute_s=0.14))
    d = MetricDetector(min_history=16, change_window=8)
    for s in range(24):
        d.observe(s, compute_s=0.1)
    kinds = [a.kind for s in range(8) for a in d.observe(24 + s, compute_s=0.16)]
    assert "step_time_change" in kinds


def test_policy_parsing_and_skip_decision() -> None:
    pol = parse_policy("loss_spike=rollback")
    assert pol["loss_spike"] == "rollback" and pol["nonfinite_loss"] == "skip_step"
    assert wants_skip(float("inf"), None, pol) == "nonfinite_loss"
    assert wants_skip(1.0, math.nan, pol) == "nonfinite_grad"
    assert wants_skip(1.0, 1.0, pol) is None
    assert wants_skip(math.nan, None, parse_policy("nonfinite_loss=none")) is None
    with pytest.raises(ValueError, match="KIND=ACTION"):
        parse_policy("loss_spike=explode")
    with pytest.raises(ValueError, match="KIND=ACTION"):
        parse_policy("typo")


def test_learned_threshold_and_robust_z() -> None:
    assert learned_threshold([0.1] * 3, 5, 0.6, 10.0) == 10.0  # not enough seen yet
    assert learned_threshold([0.1] * 10, 5, 0.6, 10.0) == 0.6  # floor
    assert learned_threshold([0.1] * 9 + [0.3], 5, 0.6, 10.0) == pytest.approx(1.5)
    assert robust_z(1.0, [1.0] * 10) == 0.0
    assert robust_z(2.0, [1.0] * 10) > 50


def test_verdict_interface_and_validation() -> None:
    v = Verdict(Culprit(2, 0, "n2", None), "straggler", 0.8, {"x": 1}, detect_s=1.5)
    f = v.fields()
    assert set(f) == {"culprit", "class", "confidence", "evidence", "detect_s"}
    assert f["culprit"] == {"replica": 2, "rank": 0, "node": "n2", "link": None}
    with pytest.raises(ValueError, match="class"):
        Verdict(Culprit(0), "weird", 0.5, {})
    with pytest.raises(ValueError, match="confidence"):
        Verdict(Culprit(0), "straggler", 1.5, {})


def test_everyone_silent_is_no_verdict() -> None:
    views = [view(0, 7, 2.0, silent=2.0), view(1, 7, 2.0, silent=2.0)]
    assert hang.classify_hang("g", views, 0.5, 1.0) is None


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=40), st.floats(0, 1))
def test_quantile_matches_numpy(xs, q) -> None:
    assert links.quantile_of(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-9, abs=1e-9)


def test_memory_rising_while_a_rank_warms_up_is_not_growth() -> None:
    # The master hands memory samples with step -1 between steps; before a rank has trained
    # memory_after_steps steps, its rise is the process warming up (imports, model, optimizer).
    d = MetricDetector(memory_window=20, memory_after_steps=5)
    assert not any(d.observe(-1, memory=1e9 * (1 + 0.05 * i)) for i in range(60))
    for s in range(5):
        d.observe(s, loss=2.0)
    kinds = [a.kind for i in range(20) for a in d.observe(-1, memory=4e9 * (1 + 0.02 * i))]
    assert "memory_growth" in kinds  # a leak once training runs is still caught
