"""The diagnosis master on synthesized telemetry batches (what ranks ship)."""

from __future__ import annotations

import json
import random

from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.master.master_state import MasterSettings
from unbroken.diagnosis.telemetry import Collective, Stall, StepMetrics, TelemetryBatch, Transfer

NS = 1_000_000_000
G = "rank0/epoch1"


def batch(now: float, records=(), open_=None, links=(), steps=(), stalls=()) -> TelemetryBatch:
    """A batch as the coordinator receives it: through JSON and the schema's checks."""
    sent = TelemetryBatch(
        now_ns=int(now * NS),
        records=list(records),
        open=open_,
        links=list(links),
        steps=list(steps),
        stalls=list(stalls),
    )
    return TelemetryBatch.from_msg(json.loads(json.dumps(sent.to_msg())))


def opened(group: str, seq: int, enter: float, members: list[int]) -> Collective:
    """A collective still open on a rank: entered at ``enter``, not left."""
    return Collective(group, seq, "allreduce", 400, int(enter * NS), 0, False, members, 0, 0)


def waiting(seq: int, direction: str, peer: int, step: int, post: float) -> Transfer:
    """A ring transfer posted at ``post`` and never finished."""
    return Transfer(G, seq, direction, peer, step, 0, int(post * NS), 0)


def run_steps(
    m: DiagnosisMaster,
    seqs: range,
    compute: dict[int, float],
    t: float = 0.0,
    queued: dict[int, float] | None = None,
    rq: dict[int, int] | None = None,
) -> tuple[float, list]:
    """Healthy collectives where replica r computes compute[r] seconds between them, of which
    queued[r] it waited for a CPU; ``rq`` carries each replica's cumulative run-queue wait (ns,
    what the recorder reads from the kernel) from one call to the next."""
    exits = {r: t for r in compute}
    rq = {} if rq is None else rq
    verdicts = []
    for seq in seqs:
        enters = {r: exits[r] + compute[r] for r in compute}
        done = max(enters.values()) + 0.01
        for r in compute:
            rq[r] = rq.get(r, 0) + int((queued or {}).get(r, 0.0) * NS)
            rec = Collective(
                G, seq, "allreduce", 400, int(enters[r] * NS), int(done * NS), True, sorted(compute), rq[r], rq[r]
            )
            m.ingest((r, 0), f"n{r}", batch(done, records=[rec]), done)
            exits[r] = done
        t = done
        verdicts += [(seq, v) for v in m.evaluate(t)]
    return t, verdicts


def test_clean_run_gives_no_verdict() -> None:
    m = DiagnosisMaster()
    _, verdicts = run_steps(m, range(200), {0: 0.1, 1: 0.1, 2: 0.1})
    assert verdicts == []


def slowdown(after: dict[int, float], warm: int = 30, steps: int = 30, settings: MasterSettings | None = None) -> list:
    """Verdicts (seq, verdict) once compute times change from 0.1 s each to ``after``."""
    m = DiagnosisMaster(settings)
    t, _ = run_steps(m, range(warm), {0: 0.1, 1: 0.1, 2: 0.1})
    return run_steps(m, range(warm, warm + steps), after, t)[1]


def test_straggler_found_within_twenty_steps() -> None:
    """At 1.5x the step-time change point sees it too, but leaves a change this big to the straggler rule."""
    verdicts = slowdown({0: 0.1, 1: 0.15, 2: 0.1}, steps=20)
    assert verdicts, "no straggler verdict within 20 steps"
    seq, v = verdicts[0]
    assert v.kind == "straggler" and v.culprit.replica == 1


def test_small_slowdown_below_the_measured_threshold_is_silent() -> None:
    """1.3x: under the straggler threshold (1.39x) and the step-time threshold measured on clean
    runs (1.45): clean runs at load 11 reached such scores, so the rule says nothing."""
    assert slowdown({0: 0.1, 1: 0.1, 2: 0.13}, warm=40) == []


def test_small_slowdown_is_a_step_time_change_at_a_lower_threshold() -> None:
    verdicts = slowdown({0: 0.1, 1: 0.1, 2: 0.13}, warm=40, settings=MasterSettings(step_time_threshold=1.2))
    assert verdicts, "a 1.3x slowdown went unreported"
    seq, v = verdicts[0]
    assert (v.kind, v.culprit.replica, v.evidence["anomaly"]) == ("metric_anomaly", 2, "step_time_change")
    assert seq < 60


def test_stopped_rank_is_named_with_its_counter() -> None:
    m = DiagnosisMaster()
    t, _ = run_steps(m, range(20), {0: 0.1, 1: 0.1, 2: 0.1})
    enter = t + 0.1
    open_ = opened(G, 20, enter, [0, 1, 2])
    for k in range(10):  # replica 2 stopped after seq 19; the others wait at seq 20
        now = enter + 0.1 * k
        for r in (0, 1):
            m.ingest((r, 0), f"n{r}", batch(now, open_=open_), now)
        if k == 2:
            assert m.evaluate(now) == []  # short waits are not hangs yet
    vs = m.evaluate(enter + 0.9)
    assert len(vs) == 1 and vs[0].kind == "noncomm_hang" and vs[0].culprit.replica == 2
    assert m.evaluate(enter + 0.95) == []  # reported once


def test_departed_member_explains_failed_waits() -> None:
    m = DiagnosisMaster()
    t, _ = run_steps(m, range(20), {0: 0.1, 1: 0.1, 2: 0.1})
    m.forget(2)
    for r in (0, 1):
        failed = Collective(G, 20, "allreduce", 400, int(t * NS), int((t + 0.01) * NS), False, [0, 1, 2], 0, 0)
        m.ingest((r, 0), f"n{r}", batch(t + 0.02, records=[failed]), t + 0.02)
    assert m.evaluate(t + 5.0) == []


def ring_collectives(
    m: DiagnosisMaster,
    seqs: range,
    dur,
    recv_late=lambda seq, src, dst, step: 0.0,
    queued=lambda seq, src, dst, step: 0.0,
    skew: dict[int, float] | None = None,
) -> list:
    """Ring all-reduces of 3 replicas; ``dur(seq, src, dst, step)`` is a transfer's time on the wire
    and ``recv_late`` how long after the sender the receiver posted (it was still computing);
    ``queued`` is added to the transfer's time as the receiving thread's wait for a CPU.
    ``skew[r]``: how much later than the truth the master maps replica r's clock (its batches'
    fastest delivery was that much slower than its peers')."""
    verdicts = []
    skew = skew or {}
    for seq in seqs:
        now = 10.0 + seq
        order = [0, 1, 2] if seq % 2 == 0 else [2, 1, 0]
        for i, src in enumerate(order):
            dst = order[(i + 1) % 3]
            for step in range(4):
                post = now + step * 0.1
                rpost = post + recv_late(seq, src, dst, step)
                q = queued(seq, src, dst, step)
                done = max(post, rpost) + dur(seq, src, dst, step) + q
                send = Transfer(G, seq, "send", dst, step, 1_000_000, int(post * NS), int(done * NS))
                recv = Transfer(
                    G, seq, "recv", src, step, 1_000_000, int(rpost * NS), int(done * NS), 5, 5 + int(q * NS)
                )
                m.ingest((src, 0), f"n{src}", batch(now + 1 - skew.get(src, 0.0), links=[send]), now + 1)
                m.ingest((dst, 0), f"n{dst}", batch(now + 1 - skew.get(dst, 0.0), links=[recv]), now + 1)
        for r in range(3):  # the collective itself, which every member completed
            rec = Collective(G, seq, "allreduce", 4, int(now * NS), int((now + 0.5) * NS), True, [0, 1, 2], 0, 0)
            m.ingest((r, 0), f"n{r}", batch(now + 1 - skew.get(r, 0.0), records=[rec]), now + 1)
        verdicts += [(seq, v) for v in m.evaluate(now + 1)]
    return verdicts


def test_slow_link_from_ring_transfers_within_twenty_collectives() -> None:
    m = DiagnosisMaster()
    wire = lambda seq, a, b, step: 0.001 * (4.0 if {a, b} == {0, 2} and seq >= 30 else 1.0)  # noqa: E731
    assert ring_collectives(m, range(30), wire) == []
    verdicts = ring_collectives(m, range(30, 60), wire)
    assert verdicts, "no verdict on a link 4x slower"
    seq, v = verdicts[0]
    assert v.kind == "comm_slow" and set(v.culprit.link) == {0, 2} and seq < 50
    assert v.evidence["pattern"] == "link" and v.evidence["slow_links"] == ["0-2"]


def test_slow_node_is_its_row_and_column() -> None:
    m = DiagnosisMaster()
    wire = lambda seq, a, b, step: 0.001 * (4.0 if 2 in (a, b) and seq >= 30 else 1.0)  # noqa: E731
    verdicts = ring_collectives(m, range(60), wire)
    assert verdicts
    seq, v = verdicts[0]
    assert (v.kind, v.culprit.replica, v.culprit.link, v.evidence["pattern"]) == ("comm_slow", 2, None, "node")
    assert 30 <= seq < 50


def test_slow_node_whose_receivers_come_late_is_named() -> None:
    """As in the box with ``tbf`` on one host: its peers' receives from it come late (they are
    still in their own slow transfers to it), and a transfer counted only when its receiver had
    waited left its links without samples: no verdict in 50 collectives. Timed from the late
    receiver's own post, they show the slow wire."""
    m = DiagnosisMaster()
    wire = lambda seq, a, b, step: 0.001 * (20.0 if 2 in (a, b) and seq >= 30 else 1.0)  # noqa: E731
    late = lambda seq, a, b, step: 0.05 if 2 in (a, b) and seq >= 30 else 0.0  # noqa: E731
    assert ring_collectives(m, range(30), wire, late) == []
    verdicts = ring_collectives(m, range(30, 60), wire, late)
    assert verdicts, "no verdict on a node whose wire is 20x slower"
    seq, v = verdicts[0]
    assert (v.kind, v.culprit.replica, v.culprit.link, v.evidence["pattern"]) == ("comm_slow", 2, None, "node")
    assert seq < 50


def test_a_lossy_link_is_named_by_its_stalls() -> None:
    """Link 1-2 drops packets after seq 30: one of its transfers in three collectives waits out a
    retransmission (0.3 s against 1 ms); its other transfers, and its floor, stay healthy."""
    m = DiagnosisMaster()
    wire = lambda seq, a, b, step: 0.3 if {a, b} == {1, 2} and seq >= 30 and seq % 3 == 0 and step == 1 else 0.001  # noqa: E731
    assert ring_collectives(m, range(30), wire) == []
    verdicts = ring_collectives(m, range(30, 60), wire)
    assert verdicts, "no verdict on a link whose transfers stall"
    seq, v = verdicts[0]
    assert (v.kind, set(v.culprit.link), v.evidence["cause"], v.evidence["stalling_links"]) == (
        "comm_slow",
        {1, 2},
        "stalling",
        ["1-2"],
    )
    assert seq < 50


def test_scheduling_noise_on_a_busy_host_is_no_slow_link() -> None:
    """Heavy-tailed extra delays (a descheduled thread) on any transfer: the floor stays healthy."""
    rng = random.Random(7)

    def wire(seq: int, a: int, b: int, step: int) -> float:
        base = 0.001 * rng.uniform(0.8, 1.25)
        return base * (1 + rng.expovariate(0.3)) if rng.random() < 0.5 else base

    assert ring_collectives(DiagnosisMaster(), range(300), wire) == []


def test_clock_offsets_between_ranks_are_no_slow_link() -> None:
    """A cell joins a sender's post and a receiver's completion, two clocks that the master maps
    with offsets good to a fraction of a millisecond, as long as a whole transfer: in a clean ring
    run on 2 shared cores, cells of replica 2 read 0.35 ms/MB slower one way and faster the other,
    and the old per-cell matrix named replica 2 a slow sender. The two directions of a link carry
    opposite errors, so a link's figure (their sum) is exact."""
    wire = lambda seq, a, b, step: 0.0005  # noqa: E731
    early = lambda seq, a, b, step: -0.002  # noqa: E731  receivers wait: every transfer is judged
    assert ring_collectives(DiagnosisMaster(), range(80), wire, early, skew={0: 0.00035, 1: 0.00035}) == []
    # The same skew with a slow link 0-2 still names that link.
    slow = lambda seq, a, b, step: 0.0005 * (20 if {a, b} == {0, 2} and seq >= 30 else 1)  # noqa: E731
    verdicts = ring_collectives(DiagnosisMaster(), range(80), slow, early, skew={0: 0.00035, 1: 0.00035})
    assert verdicts and set(verdicts[0][1].culprit.link) == {0, 2}


def test_one_slow_burst_is_no_verdict() -> None:
    wire = lambda seq, a, b, step: 0.001 * (20.0 if (a, b) == (0, 1) and 40 <= seq < 42 else 1.0)  # noqa: E731
    assert ring_collectives(DiagnosisMaster(), range(80), wire) == []


def test_a_receiver_waiting_for_a_cpu_is_a_busy_host_not_a_slow_link() -> None:
    """Seen in bench cluster's clean run on a loaded machine: one link's transfers took 4x as
    long, every extra millisecond spent by the receiving thread in the run queue."""
    busy = lambda seq, a, b, step: 0.003 if (a, b) == (1, 2) and seq >= 30 else 0.0  # noqa: E731
    assert ring_collectives(DiagnosisMaster(), range(60), lambda *_: 0.001, queued=busy) == []
    # Twice those delays on the wire (the thread was asleep in recv, not queued) are a slow link
    # (its one direction 7x: the link's two directions together 4x).
    wire = lambda seq, a, b, step: 0.001 + 2 * busy(seq, a, b, step)  # noqa: E731
    verdicts = ring_collectives(DiagnosisMaster(), range(60), wire)
    assert verdicts and verdicts[0][1].culprit.link == (1, 2)


def test_waiting_for_a_computing_peer_is_not_a_slow_link() -> None:
    """The receiver posts late on one link (it was busy): idle time is not congestion."""
    late = lambda seq, a, b, step: 0.05 if (a, b) == (1, 2) else 0.0  # noqa: E731
    assert ring_collectives(DiagnosisMaster(), range(80), lambda *_: 0.001, late) == []


def test_nan_loss_is_a_metric_anomaly_of_that_replica() -> None:
    m = DiagnosisMaster()
    m.ingest((1, 0), "n1", batch(1.0, steps=[StepMetrics(5, float("nan"), None, None)]), 1.0)
    vs = m.evaluate(1.0)
    assert [(v.kind, v.culprit.replica, v.evidence["anomaly"]) for v in vs] == [("metric_anomaly", 1, "nonfinite_loss")]


def test_stalled_ring_names_the_link_whose_send_never_finished() -> None:
    m = DiagnosisMaster()
    t = 50.0
    members = [0, 1, 2]
    # 0 -> 1 is stuck: 0 sleeps in its send (its receive from 2 arrived but is never acknowledged),
    # 1 waits for 0, and 2 waits for 1 one ring step later.
    open_ = {
        0: [waiting(7, "recv", 2, 1, t), waiting(7, "send", 1, 1, t)],
        1: [waiting(7, "recv", 0, 1, t)],
        2: [waiting(7, "recv", 1, 2, t + 0.01)],
    }
    for r in members:
        rec = Collective(G, 7, "allreduce", 4, int(t * NS), int((t + 0.5) * NS), False, members, 0, 0)
        m.ingest((r, 0), f"n{r}", batch(t + 0.6, records=[rec], stalls=[Stall(G, 7, open_[r], True)]), t + 0.6)
    verdicts = m.evaluate(t + 0.6)
    hang = [v for v in verdicts if v.kind == "comm_hang"]
    assert hang and hang[0].culprit.link == (0, 1) and hang[0].culprit.replica == 0
    assert not [v for v in m.evaluate(t + 0.7) if v.kind == "comm_hang"]  # reported once


def stalled_collective(deadline: dict[int, bool]) -> list:
    """0 -> 1 stuck at ring step 0; which members gave up at their own deadline is ``deadline``."""
    m = DiagnosisMaster()
    t = 50.0
    open_ = {
        0: [waiting(7, "send", 1, 0, t)],
        1: [waiting(7, "recv", 0, 0, t), waiting(7, "send", 2, 0, t)],
        2: [waiting(7, "recv", 1, 1, t + 0.01), waiting(7, "send", 0, 1, t + 0.01)],
    }
    for r in (0, 1, 2):
        ok = False if deadline[r] else None
        rec = Collective(G, 7, "allreduce", 4, int(t * NS), int((t + 0.5) * NS), ok, [0, 1, 2], 0, 0)
        m.ingest((r, 0), f"n{r}", batch(t + 0.6, records=[rec], stalls=[Stall(G, 7, open_[r], deadline[r])]), t + 0.6)
    return [v for v in m.evaluate(t + 0.6) if v.kind == "comm_hang"]


def test_stall_seen_by_one_deadline_and_two_aborted_members_names_the_link() -> None:
    """The first member to reach its deadline gets the others aborted; their evidence still counts."""
    hang = stalled_collective({0: False, 1: False, 2: True})
    assert hang and hang[0].culprit.link == (0, 1)


def test_stall_blame_points_at_the_ends_of_the_first_transfer_left_open_at_both_ends() -> None:
    m = DiagnosisMaster()
    t = 50.0
    open_ = {
        0: [waiting(7, "send", 1, 0, t)],
        1: [waiting(7, "recv", 0, 0, t), waiting(7, "send", 2, 0, t)],
        2: [waiting(7, "recv", 1, 1, t + 0.01)],
    }
    for r in (0, 1, 2):
        rec = Collective(G, 7, "allreduce", 4, int(t * NS), int((t + 0.5) * NS), False, [0, 1, 2], 0, 0)
        m.ingest((r, 0), f"n{r}", batch(t + 0.6, records=[rec], stalls=[Stall(G, 7, open_[r], True)]), t + 0.6)
    assert m.stall_blame([1]) == {0: 1, 1: 1}  # 0 -> 1 at step 0; 1 -> 2 is its consequence
    assert m.stall_blame([2]) == {}  # another epoch's failure: no evidence
    m.evaluate(t + 0.6)  # judged (a comm_hang): the evidence is still there for the set-aside
    assert m.stall_blame([1, 2]) == {0: 1, 1: 1}


def test_collective_failed_everywhere_without_a_deadline_is_no_comm_hang() -> None:
    """A closed connection (a crash) fails every member at once with transfers open: not a stall."""
    assert stalled_collective({0: False, 1: False, 2: False}) == []


def test_a_restarted_rank_in_its_cold_first_step_is_not_blamed_until_it_has_warmed_up() -> None:
    """A restarted replica catches up in one exchange, then its first trained step runs cold."""
    m = DiagnosisMaster()
    t, _ = run_steps(m, range(20), {0: 0.1, 1: 0.1, 2: 0.1})
    m.forget(2)  # replica 2 died and was restarted: a new process
    g2 = "rank0/epoch2"

    def cold_step(done: float, seq: int) -> list:
        """Replicas 0 and 1 wait at ``seq`` of epoch 2 while replica 2 computes its first step."""
        open_ = opened(g2, seq, done, [0, 1, 2])
        for r in (0, 1):
            m.ingest((r, 0), f"n{r}", batch(done + 3.0, open_=open_), done + 3.0)
        m.ingest((2, 0), "n2", batch(done + 3.0), done + 3.0)  # alive, computing: telemetry flows
        return m.evaluate(done + 3.0)

    catch_up = [Collective(g2, 0, "allreduce", 400, int(t * NS), int((t + 0.01) * NS), True, [0, 1, 2], 0, 0)]
    for r in (0, 1, 2):
        m.ingest((r, 0), f"n{r}", batch(t + 0.01, records=catch_up), t + 0.01)
    assert cold_step(t + 0.01, 1) == []  # its one collective so far was the catch-up
    second = [Collective(g2, 1, "allreduce", 400, int((t + 3.1) * NS), int((t + 3.2) * NS), True, [0, 1, 2], 0, 0)]
    for r in (0, 1, 2):
        m.ingest((r, 0), f"n{r}", batch(t + 3.2, records=second), t + 3.2)
    vs = cold_step(t + 3.2, 2)  # warmed up: holding the others up now is a hang
    assert [(v.kind, v.culprit.replica) for v in vs] == [("noncomm_hang", 2)]


def test_a_silent_rank_among_talking_ones_is_a_noncomm_hang() -> None:
    m = DiagnosisMaster()
    for i in range(20):
        for r in range(3):
            if r == 2 and i >= 10:
                continue  # stopped
            m.ingest((r, 0), f"n{r}", batch(100.0 + i * 0.1), 100.0 + i * 0.1)
    verdicts = m.evaluate(100.0 + 2.0)
    assert [(v.kind, v.culprit.replica) for v in verdicts] == [("noncomm_hang", 2)]
    assert m.evaluate(130.0) == []  # everyone silent: the job ended, not a hang


def test_a_silent_rank_evicted_before_the_learned_threshold_is_still_named() -> None:
    """bench diagnosis, hang_noncomm on a loaded host (load 6): the learned silence threshold
    (5x the slowest gap, here 0.4 s) was 2 s, the coordinator evicted the stopped replica at
    its 2 s heartbeat timeout first, and forget() dropped it unnamed."""
    m = DiagnosisMaster()
    for i in range(40):
        for r in range(3):
            if r == 2 and i >= 20:
                continue  # stopped at t=102
            m.ingest(
                (r, 0),
                f"n{r}",
                batch(100.0 + i * 0.1 + (0.3 if i == 5 else 0)),
                100.0 + i * 0.1 + (0.3 if i == 5 else 0),
            )
    assert m.evaluate(103.4) == []  # 1.5 s quiet: below the learned 2 s
    m.forget(2, 103.45)
    assert [(v.kind, v.culprit.replica) for v in m.evaluate(103.5)] == [("noncomm_hang", 2)]


def test_a_replica_leaving_while_it_talks_is_not_named() -> None:
    """A finished replica, or one whose connection closed at its death (a crash is the
    supervisor's to report), sent telemetry a moment ago."""
    m = DiagnosisMaster()
    for i in range(20):
        for r in range(3):
            m.ingest((r, 0), f"n{r}", batch(100.0 + i * 0.1), 100.0 + i * 0.1)
    m.forget(2, 102.0)
    assert m.evaluate(102.05) == []


def test_a_starting_rank_that_pauses_before_its_rhythm_is_known_is_not_a_hang() -> None:
    """A fresh process can stall its telemetry thread for a second (imports, GC) while starting."""
    m = DiagnosisMaster()
    for i in range(20):
        for r in range(3):
            if r == 2 and i not in (0, 1):
                continue  # two batches, then a long pause while it imports
            m.ingest((r, 0), f"n{r}", batch(100.0 + i * 0.1), 100.0 + i * 0.1)
    assert m.evaluate(100.0 + 2.0) == []


def test_one_replica_slowing_alone_is_a_step_time_anomaly() -> None:
    m = DiagnosisMaster(MasterSettings(step_time_threshold=1.2))
    t, _ = run_steps(m, range(40), {0: 0.1, 1: 0.1, 2: 0.1})
    _, verdicts = run_steps(m, range(40, 70), {0: 0.1, 1: 0.13, 2: 0.1}, t)
    kinds = {(v.kind, v.culprit.replica) for _, v in verdicts}
    assert ("metric_anomaly", 1) in kinds


def test_replicas_trading_places_on_shared_cores_is_no_verdict() -> None:
    # Three processes on two cores: the scheduler moves replica 1 onto a shared core and
    # gives replica 0 a core of its own; one slows as the other speeds up. Nothing is broken.
    m = DiagnosisMaster()
    t, _ = run_steps(m, range(40), {0: 0.1, 1: 0.1, 2: 0.1})
    _, verdicts = run_steps(m, range(40, 70), {0: 0.08, 1: 0.13, 2: 0.1}, t)
    assert verdicts == []


def run_noisy(m: DiagnosisMaster, seqs: range, compute, rng: random.Random, t: float = 0.0) -> tuple[float, list]:
    """Like :func:`run_steps`, with ``compute(replica, rng)`` drawing each compute time."""
    verdicts = []
    for seq in seqs:
        t, got = run_steps(m, range(seq, seq + 1), {r: compute(r, rng) for r in range(3)}, t)
        verdicts += got
    return t, verdicts


def jitter(x: float, rng: random.Random) -> float:
    return x * rng.uniform(0.95, 1.05)


def test_steady_small_slowdown_among_noise_is_found_within_twenty_steps() -> None:
    rng = random.Random(5)
    m = DiagnosisMaster(MasterSettings(step_time_threshold=1.2))
    t, before = run_noisy(m, range(40), lambda r, g: jitter(0.1, g), rng)
    _, verdicts = run_noisy(m, range(40, 80), lambda r, g: jitter(0.13 if r == 2 else 0.1, g), rng, t)
    assert before == []
    assert verdicts, "a steady 1.3x slowdown went unreported"
    seq, v = verdicts[0]
    assert (v.kind, v.culprit.replica, v.evidence["anomaly"]) == ("metric_anomaly", 2, "step_time_change")
    assert seq < 40 + 20


def test_bursty_slowdown_of_a_busy_machine_is_no_step_time_change() -> None:
    # A CPU hog takes replica 0's core at two steps out of three: its median moves by more than
    # the change ratio (the rule without the fastest quarter named it), but a third of its
    # steps are as fast as before.
    rng = random.Random(7)
    m = DiagnosisMaster()
    t, _ = run_noisy(m, range(40), lambda r, g: jitter(0.1, g), rng)
    medians = []
    verdicts = []
    for seq in range(40, 140):
        slow = seq % 3 != 0
        t, got = run_noisy(
            m, range(seq, seq + 1), lambda r, g, slow=slow: jitter(0.13 if r == 0 and slow else 0.1, g), rng, t
        )
        verdicts += got
        medians.append(m.detectors[(0, 0)].change_point())
    assert max(medians) >= 1.25, "the hog did not move the median: this test would prove nothing"
    assert verdicts == []


def test_a_replica_waiting_for_a_cpu_is_not_a_straggler() -> None:
    """1.5x longer between collectives, all of it queued behind other processes for a CPU: the
    machine is busy, the rank is not slow. The same 1.5x with no run-queue wait is named."""
    m, rq = DiagnosisMaster(), {}
    t, _ = run_steps(m, range(30), {0: 0.1, 1: 0.1, 2: 0.1}, rq=rq)
    _, verdicts = run_steps(m, range(30, 60), {0: 0.1, 1: 0.15, 2: 0.1}, t, queued={1: 0.05}, rq=rq)
    assert verdicts == []
    assert slowdown({0: 0.1, 1: 0.15, 2: 0.1}, steps=30)


def test_a_replica_leaving_the_exchange_sooner_is_no_slowdown() -> None:
    """Its compute (exit to next entry) grows as its exits move earlier, but the collectives
    come at the same pace: the job is as fast as ever (seen in clean ring runs)."""
    m = DiagnosisMaster()
    verdicts = []
    for seq in range(90):
        start = seq * 0.11  # every replica enters then (replica 0 a hair later: it is last)
        for r in range(3):
            leaves = start + (0.02 if r == 1 and seq >= 40 else 0.05)
            enter = start + (0.001 if r == 0 else 0.0)
            rec = Collective(G, seq, "allreduce", 400, int(enter * NS), int(leaves * NS), True, [0, 1, 2], 0, 0)
            m.ingest((r, 0), f"n{r}", batch(start + 0.05, records=[rec]), start + 0.05)
        verdicts += m.evaluate(start + 0.05)
    assert verdicts == []
