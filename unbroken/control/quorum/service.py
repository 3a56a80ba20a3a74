"""Ranks' quorum requests: gathered per replica, formed into epochs, answered, with pushed aborts.

The coordinator's connections hand each rank's ``quorum`` request here (:meth:`QuorumService.ask`).
A replica's request counts once all its ranks asked; it is then answered at once (the epoch
stands), held (the replica is set aside: :mod:`unbroken.control.quorum.setaside`) or left pending
until the pure :class:`~unbroken.control.quorum.rules.QuorumState` forms the next epoch. Each epoch
formed is recorded, answered to every member waiting for it, and its donors are told ahead;
the members of a broken epoch are told to abort their exchange. When an eviction broke it, the
next epoch is formed at once and pushed with the abort (:meth:`QuorumService.push_epoch`). What
this needs of the rest of the coordinator (evicting a replica, ending the job, the store's address as a connection sees
it) it is given through its constructor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from unbroken.control import protocol
from unbroken.control.quorum.failure import classify
from unbroken.control.quorum.grants import StepClock, grant_steps
from unbroken.control.quorum.job_health import JobHealth, JobStop
from unbroken.control.quorum.rules import QuorumDecision, QuorumRequest, QuorumState, member_runs, push_answers
from unbroken.control.quorum.setaside import SetAside
from unbroken.control.state.state_store import StateStore
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog
from unbroken.wire import jsontext


@dataclasses.dataclass
class RankConn:
    """One rank's connection, and what the coordinator knows of that rank."""

    replica: int
    rank: int
    world_size: int
    link: protocol.Link
    transfer_addr: str
    node: str
    last_heartbeat: float
    step: int = 0
    finished: bool = False
    compute_s: float | None = None  # the rank's own compute time last step, from heartbeats
    epoch: int | None = None  # the last epoch this connection was answered with
    failure: str | None = None  # the error of its exchange in the epoch its last request says failed
    pushed: QuorumDecision | None = None  # the epoch pushed to it unasked, until its next request arrives
    relayed: bool = False  # spoken for by its node's relay, which answers within a grant (control.grants)
    trains: int | None = None  # the epoch its hello said, when this coordinator resumed it (control.resume)
    store: str = ""  # the rendezvous store its node agent hosts ("" for none: control.node_relay)

    @classmethod
    def said_hello(
        cls, hello: protocol.Hello, link: protocol.Link, now: float, store: str = "", relayed: bool = False
    ) -> RankConn:
        """The connection of a rank that said ``hello`` (checked when it is registered, not here)."""
        return cls(
            replica=hello.replica,
            rank=hello.rank,
            world_size=hello.world_size,
            link=link,
            transfer_addr=hello.transfer_addr,
            node=hello.node,
            last_heartbeat=now,
            step=hello.step,
            relayed=relayed,
            store=store,
        )


# A rank's request: its connection, the request's id, the step it asks for, the epoch it says failed.
Asked = tuple[RankConn, int, int, int | None]
MAX_TAILS = 64  # wire texts kept per decision: its head, and a shared tail per store address it hands out


@dataclasses.dataclass(frozen=True)
class QuorumHooks:
    """What the quorum service may do to the coordinator around it: its doors, named.

    Attributes:
        evict: evicts a replica (cause, reason): a member that failed its epoch, one set aside.
        fail_job: ends the job (a configuration that can never work, no progress).
        store_for: the rendezvous store's address as the given connection sees it (a node's
            own store when every member can dial it, else the coordinator's).
        blame: per replica, how strongly the evidence of the given failed epochs points at it
            (the diagnosis master's ``stall_blame``); whom a run of failing epochs sets aside.
    """

    evict: Callable[[int, ev.EvictCause, str], None]
    fail_job: Callable[[JobStop], None]
    store_for: Callable[[protocol.Link], str]
    blame: Callable[[list[int]], Mapping[int, int]] | None = None


class QuorumService:
    """Answers the quorum requests of one coordinator's replicas.

    Args:
        quorum: the pure quorum state.
        replicas: the coordinator's connected ranks by replica (shared, read here).
        min_replicas: fewest replicas that may train (a set-aside never goes below it).
        store: where each epoch formed is recorded.
        events: the coordinator's event log.
        health: counts failed epochs and progress (:mod:`unbroken.control.quorum.job_health`).
        hooks: what it may do to the coordinator (:class:`QuorumHooks`).
        max_asks_per_s: requests a second past which fast answers to relayed replicas stand for
            several steps (:mod:`unbroken.control.quorum.grants`).
        max_grant_s: the longest a grant stands.
    """

    def __init__(
        self,
        quorum: QuorumState,
        replicas: dict[int, dict[int, RankConn]],
        min_replicas: int,
        store: StateStore,
        events: EventLog,
        health: JobHealth,
        hooks: QuorumHooks,
        max_asks_per_s: float = 2000.0,
        max_grant_s: float = 10.0,
    ) -> None:
        self.quorum, self.replicas, self.min_replicas = quorum, replicas, min_replicas
        self.store, self.events, self.health = store, events, health
        self.hooks = hooks
        self.pending: dict[int, dict[int, Asked]] = {}
        self.held: dict[int, dict[int, Asked]] = {}  # the requests of replicas set aside
        self.setaside = SetAside()  # replicas whose epochs keep failing (cut off from their peers)
        self.step_times: deque[float] = deque(maxlen=200)
        self.aborted: dict[int, int] = {}
        self.aborts_pushed: int | None = None  # the broken epoch whose members were told to abort
        self.hinted: dict[int, int] = {}  # newcomer -> the epoch in which its donor was told
        self.prepared: tuple[int, tuple[int, ...]] | None = None  # the last forecast told (epoch, members)
        self._hint_due = False
        self.push_due = False  # an eviction broke the epoch: push_epoch() runs once the evictions of this turn are done
        self.max_asks_per_s, self.max_grant_s = max_asks_per_s, max_grant_s
        self.clock = StepClock()  # the job's step time, from the steps asked for (what grants are sized by)
        self.granted = 0  # fast answers that stood for more than their step

    def forget(self, replica: int) -> None:
        """``replica`` is evicted: its requests are void."""
        self.pending.pop(replica, None)
        self.held.pop(replica, None)

    def release_held(self, now: float) -> set[int]:
        """Submits the requests of replicas no longer set aside; returns those still set aside."""
        held = self.setaside.held(now)
        for replica in [r for r in self.held if r not in held]:
            asked = {k: v for k, v in self.held.pop(replica).items() if self.replicas.get(replica, {}).get(k) is v[0]}
            if asked and len(asked) == next(iter(asked.values()))[0].world_size:
                self.submit(replica, asked)
        return held

    def ask(self, conn: RankConn, ask: protocol.QuorumAsk) -> None:
        """Validates a rank's quorum request, and forms or answers what it can.

        A member may not ask for a step below the one its epoch trains (steps it has committed):
        that is a replica whose state went back, and it is treated as the failure it is (evicted:
        it rejoins as a newcomer and catches up), not as a reason to re-form every member's
        epoch. A failure report counts only from a member of the current epoch about that epoch:
        anything else would let one replica abort exchanges it is not part of. A request sent
        before a pushed epoch arrived, that the push answers, is answered already: dropped.
        """
        if conn.finished:
            raise ValueError("a replica that said bye asks for no quorum")
        self._check_failed(ask)
        pushed, conn.pushed = conn.pushed, None
        if pushed is not None and push_answers(pushed, conn.replica, ask.step, ask.failed_epoch):
            conn.step = ask.step  # sent before the push arrived, which the rank took as its answer
            return
        ok, failed = self._vet(conn, ask, pushed)
        if not ok:
            return
        conn.failure = ask.failure if failed is not None else None
        conn.step = ask.step
        ranks = self.pending.setdefault(conn.replica, {})
        ranks[conn.rank] = (conn, ask.id, conn.step, failed)
        if len(ranks) < conn.world_size:
            return
        del self.pending[conn.replica]
        self.submit(conn.replica, ranks)

    def ask_ranks(self, conns: list[RankConn], ask: protocol.QuorumAsk) -> None:
        """The ranks ``conns`` ask ``ask`` in one line (a node agent's): when they are every rank
        of one replica, its request is vetted, counted and answered once, for all of them.

        Asked rank by rank, an 8-rank node cost eight validations, eight pending entries and
        eight answers built per step (150 to 215 us of the coordinator's CPU per node and step:
        docs/benchmarks/2026-11-27-coordinator-nodes.md), for what is one replica's request. All
        that is not that common case (a rank missing or named twice, a replica some ranks of
        which asked already, a bye on a rank, ranks told different epochs or pushes)
        takes the per-rank path, :meth:`ask`, whose rules this one keeps.
        """
        first = conns[0]
        replica, epoch, pushed = first.replica, first.epoch, first.pushed
        alike = len(conns) == first.world_size and replica not in self.pending and replica not in self.held
        for c in conns if alike else ():
            if c.replica != replica or c.finished or c.pushed is not pushed or c.epoch != epoch:
                alike = False
                break
        if not alike:
            for conn in conns:  # a rank whose replica an earlier one's request evicted is gone
                if self.replicas.get(conn.replica, {}).get(conn.rank) is conn:
                    self.ask(conn, ask)
            return
        self._check_failed(ask)
        if pushed is not None:  # the epoch pushed to every rank of the replica (after an eviction)
            for conn in conns:
                conn.pushed = None
            if push_answers(pushed, replica, ask.step, ask.failed_epoch):
                for conn in conns:
                    conn.step = ask.step  # sent before the push arrived, which the ranks took as their answer
                return
        ok, failed = self._vet(first, ask, pushed)
        if not ok:
            return
        failure, step, req_id = ask.failure if failed is not None else None, ask.step, ask.id
        ranks: dict[int, Asked] = {}
        for conn in conns:
            conn.failure, conn.step = failure, step
            ranks[conn.rank] = (conn, req_id, step, failed)
        if len(ranks) < first.world_size:  # a rank named twice, another not at all: it waits for the rest
            self.pending[replica] = ranks
            return
        self.submit(replica, ranks)

    def _check_failed(self, ask: protocol.QuorumAsk) -> None:
        if ask.failed_epoch is not None and ask.failed_epoch > self.quorum.epoch:
            raise ValueError(f"failed_epoch {ask.failed_epoch} was never formed (the newest is {self.quorum.epoch})")

    def _vet(
        self, conn: RankConn, ask: protocol.QuorumAsk, pushed: QuorumDecision | None = None
    ) -> tuple[bool, int | None]:
        """The rules of a request from ``conn`` (or from every rank of its replica, alike):
        whether it goes on (False: its replica was evicted), and the failed epoch it counts as.

        ``pushed``: the epoch pushed to it since its last request, which did not answer this one.
        A push places a member that had not asked at the step its peers train; one whose last
        exchange failed where theirs did not is a step short: its request fails the pushed epoch,
        which forms again with it behind, instead of evicting it as a state that went back."""
        step, failed = ask.step, ask.failed_epoch
        cur = self.quorum.current
        # This very connection trains in the current epoch (a restarted process of a member
        # of it is a newcomer: it asks for the step of its checkpoint, and catches up), told it
        # here or, by a coordinator that resumed it, by the previous one.
        member = cur is not None and cur.epoch in (conn.epoch, conn.trains) and conn.replica in cur.member_set
        if cur is not None and member and step < cur.step and pushed is not None and pushed.epoch == cur.epoch:
            failed = cur.epoch
        elif cur is not None and member and step < cur.step:
            self.hooks.evict(
                conn.replica,
                ev.EvictCause.STEP_WENT_BACK,
                f"rank {conn.rank} asked for step {step}, below step {cur.step} that its " f"epoch {cur.epoch} trains",
            )
            return False, None
        if failed is not None and not (member and cur is not None and failed == cur.epoch):
            failed = None  # not this replica's exchange to fail, or a stale report
        if ask.step_time:
            self.step_times.append(ask.step_time)
        now = time.monotonic()
        self.health.asked(now)
        if member and cur is not None and step > cur.step:
            self.setaside.progressed()
            self.health.progressed(now)
            self.clock.progressed(now, step)
        return True, failed

    def submit(self, replica: int, ranks: dict[int, Asked]) -> None:
        """A replica's request, once all its ranks asked: answered, forming, or held (set aside)."""
        now = time.monotonic()
        cur = self.quorum.current
        failed_epochs = [f for (_, _, _, f) in ranks.values() if f is not None]
        if failed_epochs and cur is not None and max(failed_epochs) == cur.epoch:
            self._judge_failure(cur.epoch, cur.members, replica, [c.failure for (c, _, _, _) in ranks.values()])
            victim = self.setaside.failed(cur.epoch, cur.members, self.min_replicas, now, self.hooks.blame)
            if victim is not None:
                self.events.emit(
                    "replica_set_aside",
                    replica=victim,
                    failed_epochs=list(self.setaside.streak),
                    hold_s=round(self.setaside.until[victim] - now, 3),
                    reason="its epochs keep failing: cut off from its peers?",
                )
                self.quorum.waiting.pop(victim, None)
                if victim in self.pending and victim != replica:
                    self.held[victim] = self.pending.pop(victim)
        if replica in self.setaside.held(now):
            self.held[replica] = ranks
            return
        conn = next(iter(ranks.values()))[0]
        failures = [f for (_, _, _, f) in ranks.values() if f is not None]
        req = QuorumRequest(
            replica=conn.replica,
            step=min(s for (_, _, s, _) in ranks.values()),
            failed_epoch=max(failures) if failures else None,
        )
        if req.failed_epoch is not None:
            self.events.emit(ev.ExchangeFailed(replica=req.replica, epoch=req.failed_epoch, step=req.step))
        newcomer = cur is None or req.replica not in cur.member_set
        answer, formed = self.quorum.request(req, time.monotonic())
        if answer is not None:
            self._reply(answer, {req.replica: ranks}, self._grant(req.replica, answer, ranks))
        else:
            self.pending[conn.replica] = ranks
        self.deliver(formed)
        self.push_aborts()
        if newcomer:  # only a newcomer's request changes the forecast: no scan of the members on every request
            self._hint_soon()

    def _grant(self, replica: int, d: QuorumDecision, ranks: dict[int, Asked]) -> int:
        """The last step the fast answer ``d`` to ``replica`` stands for (:mod:`unbroken.control.quorum.grants`):
        only a replica whose every rank its node's relay speaks for is granted more than ``d.step``."""
        if d.behind or not all(c.relayed and c.epoch == d.epoch for (c, _, _, _) in ranks.values()):
            return d.step  # only a short answer carries a grant
        steps = grant_steps(len(d.members), self.clock.step_s(), self.max_asks_per_s, self.max_grant_s)
        through = self.quorum.grant(replica, d.step, steps)
        if through > d.step:
            self.granted += 1
        return through

    def _judge_failure(self, epoch: int, members: Iterable[int], replica: int, errors: list[str | None]) -> None:
        """A replica's report that ``epoch`` failed: a configuration error at every member, epochs
        in a row, ends the job (:mod:`unbroken.control.quorum.job_health`)."""
        texts = [e for e in errors if e]
        fatal = [e for e in texts if classify(e).fatal]
        error = fatal[0] if fatal else texts[0] if texts else None
        stop = self.health.failed(epoch, members, replica, error)
        if stop is not None:
            self.hooks.fail_job(stop)

    def _hint_soon(self) -> None:
        """Hints the donors once the requests of this turn of the loop are handled: a forecast is
        a pass over the members and the newcomers, and thousands of newcomers asking in one burst
        (a job restarting, a standby taking over) made it one pass per request."""
        if self._hint_due:
            return
        self._hint_due = True
        try:
            asyncio.get_running_loop().call_soon(self.hint_donors)
        except RuntimeError:  # no loop (a test driving the service by hand): now
            self.hint_donors()

    def hint_donors(self) -> None:
        """Tells each member about to serve a newcomer, once, so it snapshots at its next step start.

        Without the hint a donor learns of its task from the quorum answer, mid-forward, and
        can snapshot only after its backward pass (the training thread owns the state); the
        transfer then spans that step and part of the next, which every member waits for.
        """
        self._hint_due = False
        epoch = self.quorum.epoch  # a forecast exists only while a decision stands
        for joiner, donor in self.quorum.upcoming_donors().items():
            if self.hinted.get(joiner) == epoch:
                continue
            self.hinted[joiner] = epoch
            self.events.emit(ev.DonorTold(newcomer=joiner, donor=donor, epoch=epoch))
            for conn in self.replicas.get(donor, {}).values():
                conn.link.send(protocol.Donate(to=joiner).to_msg())
        self.prepare_upcoming()

    def prepare_upcoming(self) -> None:
        """Tells every member of the forecast epoch (:meth:`QuorumState.upcoming_epoch`), the
        newcomers too, to build its cross-replica groups now, once per forecast: the rendezvous
        of an epoch with a newcomer took the survivors' whole step when it began with the epoch."""
        forecast = self.quorum.upcoming_epoch()
        if forecast is None or self.prepared == (forecast.epoch, forecast.members):
            return
        self.prepared = (forecast.epoch, forecast.members)
        runs = member_runs(forecast.members)
        by_store: dict[str, bytes] = {}  # one text per store the groups meet on, encoded once
        for replica in forecast.members:
            for conn in self.replicas.get(replica, {}).values():
                store = self.rendezvous(forecast, conn)
                text = by_store.get(store)
                if text is None:
                    text = by_store[store] = jsontext.dumps(protocol.Prepare(forecast.epoch, runs, store).to_msg())
                conn.link.send_payload(text)

    def deliver(self, decisions: list[QuorumDecision]) -> None:
        for d in decisions:
            self._record(d)
            waiting = {m: self.pending.pop(m) for m in d.members if m in self.pending}
            self._reply(d, waiting)

    def _record(self, d: QuorumDecision) -> None:
        self.setaside.formed(d.epoch, d.members)
        self.store.record_epoch(d.epoch, d.step, list(d.members), list(d.behind))
        self.events.emit(
            ev.Quorum(
                epoch=d.epoch,
                step=d.step,
                members=list(d.members),
                behind=list(d.behind),
                donors=[list(p) for p in d.donors],
            )
        )

    def push_epoch(self) -> None:
        """After evictions broke the current epoch: forms the next one at once and pushes it
        with the abort (:meth:`QuorumState.push`); when the rules do not allow it, only the
        abort is pushed and the members re-ask, as before.

        Run once after the evictions of one turn of the loop (an agent's loss evicts all its
        replicas: one epoch, not one per replica). The ranks that asked are answered; every
        other rank of a member gets the push (:class:`protocol.EpochPush`), which it takes as
        the answer to its next request; a member left out (silent) gets the abort alone.
        """
        self.push_due = False
        broken = self.quorum.current
        if broken is None or not self.quorum.broken:
            return
        in_flight = self.quorum.in_flight_members()
        heard = {m: min(c.step for c in self.replicas[m].values()) for m in in_flight if self.replicas.get(m)}
        d = self.quorum.push(heard)
        if d is None:
            self.push_aborts()
            return
        self._record(d)
        asked = {m: self.pending.pop(m) for m in d.members if m in self.pending}
        self._reply(d, asked)
        self._push(d, broken.epoch, {m: set(asked.get(m, ())) for m in in_flight if m in d.member_set})
        self.aborts_pushed = broken.epoch
        for replica in in_flight:
            if replica not in d.member_set and self.aborted.get(replica) != broken.epoch:
                self.aborted[replica] = broken.epoch
                for conn in self.replicas.get(replica, {}).values():
                    conn.link.send(protocol.Abort(epoch=broken.epoch).to_msg())
        self.hint_donors()

    def _push(self, d: QuorumDecision, abort: int, ranks_of: dict[int, set[int]]) -> None:
        """Pushes ``d`` with the abort of epoch ``abort`` to each rank of the replicas in
        ``ranks_of`` but the ranks named there (they asked, and were answered)."""
        pushes: dict[str, bytes] = {}
        decision = {**d.to_json(), "donors": []}
        head = b""  # the decision's text for those named in donor pairs (protocol.decision_head), made once
        donors = d.donor_map
        pairs = d.donors_by_replica() if d.donors else {}
        for replica, answered in ranks_of.items():
            self.aborted[replica] = abort
            ranks = self.replicas.get(replica, {})
            for rank, conn in ranks.items():
                if rank in answered:
                    continue
                conn.epoch, conn.pushed = d.epoch, d
                store = self.rendezvous(d, conn)
                head = head or protocol.decision_head(decision)
                if replica in pairs:
                    donor = donors.get(replica)
                    peer = self.replicas.get(donor, {}).get(rank) if donor is not None else None
                    addrs = {str(donor): peer.transfer_addr} if peer is not None else {}
                    tail = protocol.paired_tail(head, pairs[replica], addrs, store)
                    conn.link.send_payload(protocol.push_payload(abort, tail))
                    continue
                payload = pushes.get(store)  # the same text for every rank of the same store: made once
                if payload is None:
                    payload = pushes[store] = protocol.push_payload(abort, protocol.paired_tail(head, [], {}, store))
                conn.link.send_payload(payload)
            # Out now, not once every replica's push is queued: the first nodes read theirs while the
            # rest is made (at 12,500 nodes the first line left after all 100,000 were queued). A
            # node's first rank sends its line; the others find nothing held.
            for conn in ranks.values():
                conn.link.flush()

    def rendezvous(self, d: QuorumDecision, conn: RankConn) -> str:
        """The store ``conn``'s cross-replica group of epoch ``d`` meets on: the one hosted by the
        node agent that speaks for that group's rank of :attr:`QuorumDecision.leader`, else the
        coordinator's (as ``conn`` sees it).

        One group, one store on one of its members' nodes: at 100,000 ranks every group meeting
        on the coordinator's store (a thread per connection, at most 4,096 of them) could not
        even connect. Chosen once per decision and rank index (:attr:`QuorumDecision.stores`),
        so every member of a group is told the same store, whenever it asks."""
        chosen = d.stores.get(conn.rank)
        if chosen is None:
            peer = self.replicas.get(d.leader, {}).get(conn.rank)
            chosen = d.stores[conn.rank] = peer.store if peer is not None else ""
        return chosen or self.hooks.store_for(conn.link)

    def _reply(self, d: QuorumDecision, waiting: dict[int, dict[int, Asked]], through: int | None = None) -> None:
        """Answers the ranks in ``waiting`` with ``d`` (a fast answer standing ``through`` that step: its
        short answer says so, for the node's relay).

        A connection already told this epoch gets the short answer (:class:`protocol.QuorumSame`):
        the fast path costs the same at 5,000 members as at 3. A full answer's text is made once
        per store address and shared; only a replica that is behind gets a transfer address, its
        donor's (the one it fetches from), so an epoch's answers do not carry every member's
        address to every member (at 1,000 members that was 35 KB per answer, 35 MB per epoch),
        and a member named in donor pairs gets those alone (every pair to every member was 60 KB
        an answer with most of 5,000 members behind).
        """
        wire = d.wire  # the decision's texts, shared by every _reply of it
        decision: dict[str, object] | None = None
        donors = d.donor_map
        pairs = d.donors_by_replica() if d.donors else {}  # a member gets only the pairs that name it
        full_id, full_tail, full = -1, b"", b""
        same_id, same = -1, b""  # a node's ranks share their request's id: one short answer's text for all
        for replica, ranks in waiting.items():
            for rank, (conn, req_id, _, _) in ranks.items():
                if conn.epoch == d.epoch and not d.behind:
                    if req_id != same_id:
                        same_id, same = req_id, protocol.same_payload(req_id, d.epoch, d.step, through)
                    conn.link.send_payload(same)
                    continue
                conn.epoch = d.epoch
                store = self.rendezvous(d, conn)
                donor = donors.get(replica)
                head = wire.get("head")
                if head is None:
                    decision = decision or d.to_json()
                    head = wire["head"] = protocol.decision_head(decision)
                if replica in pairs:
                    addrs: dict[str, str] = {}
                    if donor is not None:  # the address of its donor's rank of the same index
                        peer = self.replicas.get(donor, {}).get(rank)
                        addrs = {str(donor): peer.transfer_addr} if peer is not None else {}
                    mine = protocol.paired_tail(head, pairs[replica], addrs, store)
                    conn.link.send_payload(protocol.answer_payload(req_id, mine))
                    continue
                shared = wire.get(store)
                if shared is None:
                    if len(wire) >= MAX_TAILS:  # stores of many leader nodes: the head stays, made once
                        wire.clear()
                        wire["head"] = head
                    shared = wire[store] = protocol.paired_tail(head, [], {}, store)
                if req_id != full_id or shared is not full_tail:
                    full_id, full_tail, full = req_id, shared, protocol.answer_payload(req_id, shared)
                conn.link.send_payload(full)

    def push_aborts(self) -> None:
        """Tells every member still in the broken epoch's exchange to abort it, once per epoch.

        Once: the members of a broken epoch only leave it, never join it, so after the first push
        every later call would scan the whole membership (on each request while forming) to
        find nobody.
        """
        cur = self.quorum.current
        if cur is None or not self.quorum.broken or self.aborts_pushed == cur.epoch or self.push_due:
            return
        self.aborts_pushed = cur.epoch
        for replica in self.quorum.in_flight_members():
            if self.aborted.get(replica) == cur.epoch:
                continue
            self.aborted[replica] = cur.epoch
            for conn in self.replicas.get(replica, {}).values():
                conn.link.send(protocol.Abort(epoch=cur.epoch).to_msg())
