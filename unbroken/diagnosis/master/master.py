"""The diagnosis master: telemetry in, verdicts out (pure; the coordinator hosts it).

Every rank ships small batches of its flight recorder (see :mod:`unbroken.comm.recorder`):
finished collectives, the open one, ring transfers, step metrics. The master keeps a bounded
view per rank and, on :meth:`evaluate`, applies the rules in order of urgency: hangs, then
stragglers, then slow connections, then metric anomalies. Times are the coordinator's clock:
each rank's monotonic clock is mapped with the smallest offset seen (send -> receive latency
can only add). A finding is reported once until it clears.

Nothing here grows with the length of the job: every membership change opens a new collective
group, and a rank's per-group state (counters, exits, failed waits) is kept for its
``group_window`` newest groups only; group members are kept while some rank's window, stall or
arrival still names the group. The coordinator rescans this state every tick (50 ms, on its
event loop): with every epoch kept, 200 stalls across 64 replicas made one tick take 0.45 s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from unbroken.diagnosis.master.connections import ConnectionMatrix
from unbroken.diagnosis.master.master_state import (
    Ident,
    MasterSettings,
    OpenCollective,
    OpenRecv,
    RankOffsets,
    RankState,
)
from unbroken.diagnosis.robust import learned_threshold, median
from unbroken.diagnosis.rules import hang, ports, steptime, straggler
from unbroken.diagnosis.rules.metrics import DEFAULT_POLICY, MetricDetector
from unbroken.diagnosis.telemetry import StepMetrics, TelemetryBatch
from unbroken.diagnosis.verdict import (
    COMM_HANG,
    COMM_SLOW,
    METRIC_ANOMALY,
    NONCOMM_HANG,
    STRAGGLER,
    Culprit,
    Verdict,
)

PORT_EVENTS_KEPT = 512  # the newest ICCL port events (down, up, ...) of the whole job


class DiagnosisMaster:
    """Holds the telemetry of every rank and turns it into :class:`Verdict` objects."""

    on_scores: Callable[[dict[str, dict[str, float]]], None] | None = None

    def __init__(self, settings: MasterSettings | None = None, policy: dict[str, str] | None = None) -> None:
        self.s = settings or MasterSettings()
        self.policy = policy or dict(DEFAULT_POLICY)
        self.ranks: dict[Ident, RankState] = {}
        self.members: dict[str, list[int]] = {}
        self.waits: deque[float] = deque(maxlen=200)
        self.arrivals: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
        self.compute: dict[int, dict[int, deque[float]]] = {}  # rank -> replica -> compute times
        self.best: dict[int, dict[int, float]] = {}
        self.last: dict[int, deque[int]] = {}
        # rank -> seconds between consecutive collectives' last arrivals: the job's own pace
        self.cadence: dict[int, deque[float]] = {}
        self._last_start: dict[int, float] = {}
        self.links = ConnectionMatrix(self.s)  # the ring's transfers, per (sender, receiver) replicas
        self.detectors: dict[Ident, MetricDetector] = {}
        self._pending_metric: list[Verdict] = []
        self._pending_silent: list[Verdict] = []  # evicted while silent (see forget)
        self._change_streak: dict[Ident, tuple[int, int, int]] = {}  # first, length, at collective
        self._straggler_streak: dict[int, tuple[Any, int, int]] = {}
        self._arrived = 0  # collectives completed by every member so far
        self._judged = -1  # the value of _arrived the collective-driven rules last ran at
        self._periodic: list[Verdict] = []
        self._epoch_group: dict[int, str] = {}
        self._reported: dict[tuple[Any, ...], float] = {}
        # (group, seq, rank) -> replica -> transfers still open when it abandoned the collective
        self.stalls: dict[tuple[str, int, int], dict[int, list[tuple[str, int, int, float]]]] = {}
        self._abandoned: deque[tuple[str, dict[int, list[tuple[str, int, int, float]]]]] = deque(maxlen=64)
        # ... of which at least one member gave up at its own deadline; the others may have been
        # aborted by the coordinator because of it (a crash fails every member at once instead)
        self._deadline_passed: set[tuple[str, int, int]] = set()
        self._members_cap = 64  # members are pruned to the groups still named when they pass this
        # ICCL port events in the coordinator's clock, with the replica whose port it is
        self.port_events: deque[dict[str, Any]] = deque(maxlen=PORT_EVENTS_KEPT)
        # The collective-driven rules' scores at the newest collective (rule -> who -> score),
        # handed to ``on_scores`` when set: ``bench diagnosis`` calibrates thresholds with them.
        self.last_scores: dict[str, dict[str, float]] = {}

    # -- ingest ----------------------------------------------------------------------------

    def ingest(self, ident: Ident, node: str, batch: TelemetryBatch, now: float) -> None:
        """Takes one telemetry batch from ``ident``, received at coordinator time ``now``."""
        r = self.ranks.get(ident)
        if r is None:
            r = self.ranks[ident] = RankState(node=node, last_seen=now)
        else:
            r.gaps.append(now - r.last_seen)
            r.last_seen = now
        off = now - batch.now_ns / 1e9
        r.offset_s = off if r.offset_s is None else min(r.offset_s, off)
        to_c = r.offset_s
        replica, rank = ident
        for c in batch.records:
            group, seq = c.group, c.seq
            rq_enter, rq_exit = c.rq_enter_ns / 1e9, c.rq_exit_ns / 1e9
            self._group(r, group, c.members)
            r.entered[group] = max(r.entered.get(group, -1), seq)
            enter, exit_ = c.enter_ns / 1e9 + to_c, c.exit_ns / 1e9 + to_c
            r.latest = group
            if c.ok:
                r.completed += 1
                self.waits.append(exit_ - enter)
                exits = r.exits.setdefault(group, {})
                prev = exits.get(seq - 1)
                exits[seq] = (exit_, rq_exit)
                exits.pop(seq - 8, None)
                if prev is not None:
                    # The rank's own compute: the time since its last collective, less the time
                    # it waited for a CPU others held (a busy machine is not a slow rank).
                    waited = max(0.0, rq_enter - prev[1])
                    self._arrival(rank, group, seq, replica, enter, max(0.0, enter - prev[0] - waited))
                r.failed.pop(group, None)
            elif c.ok is False:
                r.failed[group] = (seq, enter)  # abandoned: the peer it waited for never came
        op = batch.open
        if op is not None:
            self._group(r, op.group, op.members)
            r.entered[op.group] = max(r.entered.get(op.group, -1), op.seq)
            r.open = OpenCollective(op.group, op.seq, op.enter_ns / 1e9 + to_c)
            r.latest = op.group
        else:
            r.open = None
        offsets = RankOffsets(self.ranks)
        for t in batch.links:
            self.links.half(
                t.group,
                t.seq,
                t.ring_step,
                t.direction,
                ident,
                t.peer,
                t.post_ns / 1e9,
                t.done_ns / 1e9,
                t.nbytes,
                max(0, t.rq_done_ns - t.rq_post_ns) / 1e9,
                offsets,
            )
        for stall in batch.stalls:
            got = self.stalls.setdefault((stall.group, stall.seq, rank), {})
            got[replica] = [(t.direction, t.peer, t.ring_step, t.post_ns / 1e9 + to_c) for t in stall.transfers]
            if stall.deadline_passed:
                self._deadline_passed.add((stall.group, stall.seq, rank))
            if len(self.stalls) > 64:
                oldest = next(iter(self.stalls))
                del self.stalls[oldest]
                self._deadline_passed.discard(oldest)
        r.open_recvs = [
            OpenRecv(t.group, t.seq, t.peer, t.ring_step, t.post_ns / 1e9 + to_c)
            for t in batch.open_links
            if t.direction == "recv"
        ]
        r.open_steps = {}
        for t in batch.open_links:
            r.open_steps[t.group] = max(r.open_steps.get(t.group, -1), t.ring_step)
        r.flags = list(batch.flags)
        self.port_events.extend(ports.port_event(now, replica, p) for p in batch.paths)
        det = self._detector(ident)
        steps = list(batch.steps)
        if batch.memory is not None:
            steps.append(StepMetrics(-1, None, None, batch.memory))
        for m in steps:
            for a in det.observe(m.step, loss=m.loss, grad_norm=m.grad_norm, memory=m.memory):
                if self.policy.get(a.kind, "none") != "none" or a.kind.startswith("nonfinite"):
                    self._pending_metric.append(
                        Verdict(
                            Culprit(replica, rank, node),
                            METRIC_ANOMALY,
                            0.9,
                            {
                                "anomaly": a.kind,
                                "step": a.step,
                                "value": a.value,
                                "action": self.policy.get(a.kind),
                                **a.evidence,
                            },
                        )
                    )

    def _group(self, r: RankState, group: str, members: list[int]) -> None:
        """Notes that ``r`` works in ``group``; a rank's oldest group beyond the window is dropped."""
        if group not in self.members and len(self.members) >= self._members_cap:
            self._prune_members()
        self.members[group] = list(members)
        if group in r.entered:
            return
        r.entered[group] = -1
        while len(r.entered) > self.s.group_window:
            old = next(iter(r.entered))
            del r.entered[old]
            r.exits.pop(old, None)
            r.failed.pop(old, None)

    def _prune_members(self) -> None:
        """Keeps the members of the groups still named anywhere; amortized over the groups added."""
        live = {g for r in self.ranks.values() for g in r.entered}
        live |= {k[0] for k in self.stalls} | {k[0] for k in self.arrivals}
        for group in [g for g in self.members if g not in live]:
            del self.members[group]
        self._members_cap = max(64, 2 * len(self.members))

    def footprint(self) -> int:
        """Entries held, all containers together: what a long job must not grow."""
        per_rank = sum(
            len(r.entered)
            + len(r.failed)
            + sum(len(x) for x in r.exits.values())
            + len(r.gaps)
            + len(r.open_recvs)
            + len(r.open_steps)
            for r in self.ranks.values()
        )
        return (
            per_rank
            + len(self.ranks)
            + len(self.members)
            + len(self.waits)
            + sum(len(x) for x in self.arrivals.values())
            + sum(len(d) for d in self.best.values())
            + sum(len(x) for c in self.compute.values() for x in c.values())
            + sum(len(x) for x in self.last.values())
            + sum(len(x) for x in self.cadence.values())
            + len(self.links)
            + len(self.detectors)
            + len(self._change_streak)
            + len(self._straggler_streak)
            + len(self._epoch_group)
            + len(self._reported)
            + sum(len(x) for x in self.stalls.values())
            + len(self._abandoned)
            + len(self._deadline_passed)
        )

    def _detector(self, ident: Ident) -> MetricDetector:
        det = self.detectors.get(ident)
        if det is None:
            det = self.detectors[ident] = MetricDetector(change_window=self.s.straggler_window, memory_window=600)
        return det

    def _arrival(self, rank: int, group: str, seq: int, replica: int, enter: float, compute_s: float) -> None:
        key = (group, seq)
        got = self.arrivals.setdefault(key, {})
        got[replica] = (enter, compute_s)
        members = self.members.get(group, [])
        if len(members) < 2 or set(got) != set(members):
            if len(self.arrivals) > 64:
                self.arrivals.pop(next(iter(self.arrivals)))
            return
        del self.arrivals[key]
        self._arrived += 1
        if self._epoch_group.get(rank) != group:
            # A new epoch: recovery (a donor's snapshot, a joiner's catch-up) makes the first
            # steps uneven for reasons that are not a straggler; judge the new group afresh.
            self._epoch_group[rank] = group
            self.compute.pop(rank, None)
            self.last.pop(rank, None)
            self.best.pop(rank, None)
            self.cadence.pop(rank, None)
            self._last_start.pop(rank, None)
            for ident, det in self.detectors.items():
                if ident[1] == rank:
                    det.compute.clear()
        start, prev = max(e for e, _ in got.values()), self._last_start.get(rank)
        self._last_start[rank] = start
        if prev is not None:
            maxlen = self._detector((next(iter(got)), rank)).compute.maxlen  # pace and compute align
            self.cadence.setdefault(rank, deque(maxlen=maxlen)).append(start - prev)
        comp = self.compute.setdefault(rank, {})
        for rep, (_, c) in got.items():
            self._detector((rep, rank)).compute.append(c)
            comp.setdefault(rep, deque(maxlen=self.s.straggler_window)).append(c)
            xs = comp[rep]
            if len(xs) == xs.maxlen:
                best = self.best.setdefault(rank, {})
                best[rep] = min(best.get(rep, float("inf")), median(xs))
        self.last.setdefault(rank, deque(maxlen=self.s.straggler_window)).append(max(got, key=lambda k: got[k][0]))

    # -- thresholds ------------------------------------------------------------------------

    @property
    def hang_s(self) -> float:
        return learned_threshold(self.waits, self.s.hang_factor, self.s.hang_floor_s, self.s.hang_initial_s)

    def silent_s(self) -> float:
        gaps = [g for r in self.ranks.values() for g in r.gaps]
        return learned_threshold(gaps, self.s.silent_factor, self.s.silent_floor_s, self.s.silent_floor_s)

    # -- evaluate --------------------------------------------------------------------------

    def forget(self, replica: int, now: float | None = None) -> None:
        """A replica left the job (evicted or finished): its silence is no longer news.

        With ``now``, a rank of it that had been silent longer than ever before (and at least
        ``silent_floor_s``) while its peers talked is named first (``noncomm_hang``, reported
        by the next :meth:`evaluate`): the coordinator evicts a silent replica at its heartbeat
        timeout, which on a loaded host comes before the learned silence threshold (5x the
        slowest gap of any rank), and the hang would then go unnamed. The eviction is the
        coordinator's own evidence that the silence was real; the verdict only names its class,
        and a wrong one costs little (the replica is already out). A finished replica, or one
        whose connection closed at its death, has sent telemetry a moment ago: nothing is named.
        """
        if now is not None:
            self._pending_silent += [v for v in self._silent(now, evicted=replica) if v.culprit.replica == replica]
        for ident in [i for i in self.ranks if i[0] == replica]:
            del self.ranks[ident]
        self.links.forget(replica)
        for comp in self.compute.values():
            comp.pop(replica, None)
        for best in self.best.values():
            best.pop(replica, None)
        for key in [k for k in self._change_streak if k[0] == replica]:
            del self._change_streak[key]
        for ident in [i for i in self.detectors if i[0] == replica]:
            # A restarted replica's first loss comes from fresh weights: not a spike to report.
            del self.detectors[ident]

    def evaluate(self, now: float) -> list[Verdict]:
        """New verdicts since the last call (each finding once until it clears)."""
        if self._judged != self._arrived:
            # Stragglers, slow connections and step-time changes only move with a new collective:
            # between collectives the last findings stand (and keep their findings reported).
            self._judged = self._arrived
            self._periodic = self._stragglers(count=True) + self._slow_links() + self._step_time()
            if self.on_scores is not None:
                self.on_scores(self.last_scores)
        found = (
            self._hangs(now)
            + self._stalled(now)
            + self._silent(now)
            + self._pending_silent
            + self._periodic
            + self._pending_metric
        ) + ports.port_verdicts(self.port_events, now)
        self._pending_metric = []
        self._pending_silent = []
        fresh = []
        for v in found:
            if v.key not in self._reported:
                fresh.append(v)
            self._reported[v.key] = now
        for key, t in list(self._reported.items()):
            if now - t > 30.0:
                del self._reported[key]
        return fresh

    def _hangs(self, now: float) -> list[Verdict]:
        out = []
        silent_s = self.silent_s()
        # A failed wait counts only at the rank's latest group (below): older ones explain nothing.
        groups = {r.open.group for r in self.ranks.values() if r.open} | {
            r.latest for r in self.ranks.values() if r.latest in r.failed
        }
        for group in groups:
            members = self.members.get(group, [])
            rank = next((i[1] for i, r in self.ranks.items() if group in r.entered), 0)
            views = []
            for m in members:
                r = self.ranks.get((m, rank))
                if r is None:
                    continue
                wait = None
                if r.open and r.open.group == group:
                    wait = now - r.open.enter
                elif group in r.failed and r.latest == group and r.failed[group][0] == r.entered.get(group):
                    wait = now - r.failed[group][1]
                opens = tuple(
                    hang.OpenTransfer(o.peer, o.ring_step, now - o.post) for o in r.open_recvs if o.group == group
                )
                views.append(
                    hang.RankView(
                        m,
                        rank,
                        r.node,
                        r.entered.get(group, -1),
                        wait,
                        now - r.last_seen,
                        opens,
                        r.open_steps.get(group),
                        max(r.exits.get(group, {}), default=-1),
                    )
                )
            if len(views) < len(members):
                continue  # a member left the job: its peers' failed waits are explained
            f = hang.classify_hang(group, views, self.hang_s, silent_s)
            if f is not None and not self._warming_up(f):
                out.append(Verdict(f.culprit, f.kind, f.confidence, f.evidence))
        return out

    def _warming_up(self, f: hang.HangFinding) -> bool:
        """Whether ``f`` blames a rank still in its first steps (see ``warmup_collectives``)."""
        if f.kind != NONCOMM_HANG or f.culprit.rank is None:
            return False
        r = self.ranks.get((f.culprit.replica, f.culprit.rank))
        return r is not None and r.completed < self.s.warmup_collectives

    def _stalled(self, now: float) -> list[Verdict]:
        """Members abandoned the same collective at a deadline: a communication hang.

        Counters are equal, so no rank is behind; the stalled transfer names the link. A
        receive is stalled only if its sender's send is open too: a rank stuck in its send
        cannot acknowledge receives that did arrive, and those must not be blamed.
        """
        out = []
        for key, got in list(self.stalls.items()):
            group, seq, rank = key
            members = self.members.get(group, [])
            paired, recvs = _open_receives(got)
            # Both ends of one transfer saying it never finished is evidence enough; the others
            # may have been aborted by the coordinator before their own deadline.
            if len(members) < 2 or key not in self._deadline_passed or not (paired or set(members) <= set(got)):
                continue
            del self.stalls[key]
            self._deadline_passed.discard(key)
            self._abandoned.append((group, got))
            if not (paired or recvs):
                continue
            step, post, sender, receiver = min(paired or recvs)
            node = self.ranks.get((sender, rank), RankState("", 0)).node or None
            evidence = {
                "group": group,
                "seq": seq,
                "ring_step": step,
                "stalled_s": round(now - post, 3),
                "open_transfers": {
                    str(m): [f"{d} {'to' if d == 'send' else 'from'} {p} @ring step {s}" for d, p, s, _ in links]
                    for m, links in got.items()
                },
                "reason": f"seq {seq} was abandoned at a deadline; the transfer {sender} -> "
                f"{receiver} at ring step {step} never completed"
                + ("" if paired else " (its sender's side is unknown)"),
            }
            out.append(
                Verdict(Culprit(sender, rank, node, (sender, receiver)), COMM_HANG, 0.9 if paired else 0.6, evidence)
            )
        return out

    def stall_blame(self, epochs: Collection[int]) -> dict[int, int]:
        """Per replica, how many collectives of ``epochs`` abandoned at a deadline had it at an
        end of their earliest transfer that both ends left open: around whom a run of failing
        epochs breaks (the coordinator sets aside a member of such a run,
        :mod:`unbroken.control.quorum.setaside`). Empty without such evidence (no ring, or
        nothing left open at both ends)."""
        out: dict[int, int] = {}
        for group, got in [(k[0], g) for k, g in self.stalls.items()] + list(self._abandoned):
            _, _, epoch = group.rpartition("/epoch")
            if not epoch.isdigit() or int(epoch) not in epochs:
                continue
            paired, _ = _open_receives(got)
            if paired:
                _, _, sender, receiver = min(paired)
                for m in (sender, receiver):
                    out[m] = out.get(m, 0) + 1
        return out

    def _silent(self, now: float, evicted: int | None = None) -> list[Verdict]:
        """A rank whose telemetry stopped while its peers' goes on is not running (stopped, frozen).

        Telemetry comes from the connection's own thread, so a rank busy computing or waiting in
        a collective still talks; silence means the whole process is stuck. This catches the
        hang even when the coordinator routes around it before anyone waited ``hang_s``.
        """
        silent_s = self.silent_s()
        talking = [i for i, r in self.ranks.items() if now - r.last_seen < silent_s and i[0] != evicted]
        if not talking:
            return []  # nobody talks: the job ended or the coordinator itself stalled
        out = []
        for ident, r in self.ranks.items():
            quiet = now - r.last_seen
            bar = silent_s
            if ident[0] == evicted:  # the coordinator gave up on it: longer than ever before is enough
                bar = max(self.s.silent_floor_s, max(r.gaps, default=silent_s))
            if quiet < bar or len(r.gaps) < self.s.silent_min_batches:
                continue
            evidence = {
                "group": r.latest,
                "seq": r.entered.get(r.latest, -1),
                "silent_s": round(quiet, 3),
                "silent_threshold_s": round(bar, 3),
                "peers_seq": {str(i[0]): self.ranks[i].entered.get(r.latest, -1) for i in talking},
                "reason": f"replica {ident[0]} rank {ident[1]} has sent no telemetry for {quiet:.2f}s while "
                f"its peers do: its process is stopped or frozen",
            }
            out.append(Verdict(Culprit(ident[0], ident[1], r.node), NONCOMM_HANG, 0.85, evidence))
        return out

    def _stragglers(self, count: bool = False) -> list[Verdict]:
        out = []
        if count:
            self.last_scores["straggler"] = {
                f"{rep}/{rank}": round(rel, 4)
                for rank, comp in self.compute.items()
                if all(len(xs) >= self.s.straggler_window for xs in comp.values())
                for rep, (rel, _) in straggler.scores(comp, self.best.get(rank, {})).items()
            }
        for rank, comp in self.compute.items():
            f = straggler.find_straggler(
                comp,
                list(self.last.get(rank, ())),
                self.best.get(rank, {}),
                self.s.straggler_threshold,
                min_samples=self.s.straggler_window,
            )
            if count:  # must hold over new collectives: one slow burst is not a straggler
                key = f.replica if f else None
                prev_key, n, at = self._straggler_streak.get(rank, (None, 0, -1))
                if key != prev_key:
                    n = 1
                elif at != self._arrived:
                    n += 1
                self._straggler_streak[rank] = (key, n, self._arrived)
                if f is None or n < self.s.straggler_confirm:
                    continue
            if f is not None:
                node = self.ranks.get((f.replica, rank), RankState("", 0)).node or None
                out.append(
                    Verdict(Culprit(f.replica, rank, node), STRAGGLER, min(1.0, 0.5 + (1 - f.relative)), f.evidence)
                )
        return out

    def _slow_links(self) -> list[Verdict]:
        f = self.links.judge(RankOffsets(self.ranks), self._arrived, self.last_scores)
        if f is None:
            return []
        node = next((r.node for i, r in self.ranks.items() if i[0] == f.replica), None)
        ev = {"pattern": f.pattern, "cause": f.cause, **f.evidence}
        return [Verdict(Culprit(f.replica, None, node if f.pattern != "link" else None, f.link), COMM_SLOW, 0.8, ev)]

    def _step_time(self) -> list[Verdict]:
        out = []
        scores = self.last_scores.setdefault("step_time", {})
        scores.clear()
        for rank, comp in self.compute.items():
            stragglers = {v.culprit.replica for v in self._stragglers()}
            xs = {rep: list(self._detector((rep, rank)).compute) for rep in comp}
            cadence = list(self.cadence.get(rank, ()))
            w, hist = self.s.straggler_window, MetricDetector.min_history  # every detector's windows
            ratios = {rep: steptime.median_ratio(ys, w, hist) for rep, ys in xs.items()}
            for rep in comp:
                score = steptime.gated_score(rep, xs, cadence, w, hist, ratios)
                if score is not None:
                    scores[f"{rep}/{rank}"] = round(score, 4)
                key = (rep, rank)
                # Counted in new collectives: one slow burst re-read at every tick is one burst.
                _, n, at = self._change_streak.get(key, (0, 0, -1))
                n = (n + (at != self._arrived)) if score and score >= self.s.step_time_threshold else 0
                first = self._change_streak.get(key, (self._arrived, 0, 0))[0] if n > 1 else self._arrived
                self._change_streak[key] = (first, n, self._arrived)
                # A big change is a straggler, which the straggler rule names with better evidence.
                if n < self.s.confirm or rep in stragglers:
                    continue
                if (
                    steptime.straggler_coming(
                        xs[rep], self.s.confirm, self.s.straggler_window, self.s.straggler_threshold
                    )
                    and self._arrived - first < self.s.confirm + self.s.straggler_confirm
                ):
                    continue
                node = self.ranks.get((rep, rank), RankState("", 0)).node or None
                ratio = ratios[rep]
                out.append(
                    Verdict(
                        Culprit(rep, rank, node),
                        METRIC_ANOMALY,
                        0.7,
                        {
                            "anomaly": "step_time_change",
                            "recent_over_baseline": round(ratio or 0.0, 3),
                            "shift_score": round(score or 0.0, 3),
                            "threshold": self.s.step_time_threshold,
                            "action": self.policy.get("step_time_change"),
                        },
                    )
                )
        return out


def _open_receives(
    got: dict[int, list[tuple[str, int, int, float]]],
) -> tuple[list[tuple[int, float, int, int]], list[tuple[int, float, int, int]]]:
    """The receives a collective's members left open, as (ring step, post, sender, receiver):
    those whose sender's send is open too, and all of them."""
    sends = {(m, peer, step) for m, links in got.items() for d, peer, step, _ in links if d == "send"}
    recvs = [(step, post, peer, m) for m, links in got.items() for d, peer, step, post in links if d == "recv"]
    return [x for x in recvs if (x[2], x[3], x[0]) in sends], recvs
