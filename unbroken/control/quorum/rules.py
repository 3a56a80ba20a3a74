"""Quorum rules: who trains together at which step, under which epoch.

Pure logic with time passed in, so every rule is unit-tested without sockets. The coordinator
service feeds it events (a replica connected, asked, went away) and delivers the decisions it
returns.

The rules, in the order they are checked:

* **Fast path**: a member of the current epoch asking for the next step while nothing changed
  gets the current membership at once. The first fast answer for a step fixes that step's
  membership: everybody asking for the same step gets the same answer, so a late joiner can
  never split one step's exchange between two epochs; it is admitted at the next step.
* **Forming**: anything else (a failure report, a member gone, a newcomer, a step that went
  backwards) starts forming a new epoch. It forms as soon as every live replica has asked, or
  after the join window with those who asked; a replica that has gone silent (missed a few
  heartbeats, as a hung process does) is not waited for, though it still counts as alive for
  the majority, and only with at least ``min_replicas`` and a
  strict majority of the replicas alive at the coordinator, so two halves can never both
  train.
* **Pushed**: when an eviction breaks the current epoch, the next one is formed at once
  (:meth:`QuorumState.push`) from the replicas that asked and the members still heard, each at
  the step it trains, under the same majority, ``min_replicas`` and reservation rules; it
  reaches the members in flight with the abort of the broken epoch, and a member takes it as
  the answer to its next request when it fits (:func:`push_answers`), instead of asking.
* **Catch-up**: members whose step is behind the newest step in the new quorum are marked
  behind and each gets a donor, spread round-robin across the up-to-date members.
* **Hot spares** (``max_members``): an epoch has at most ``max_members`` members; the members
  of the epoch before come first, then the replicas furthest along, then the lowest ids. A
  replica left out is *parked*: its request stays unanswered, it does not start forming or hold
  up a step, and it is the first candidate when an epoch forms again (a member lost), so a
  replica that has already started, built its model and connected takes the lost one's place
  in the pushed epoch and catches up from a peer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from unbroken.control.quorum.grants import grant_through


@dataclasses.dataclass(frozen=True)
class QuorumRequest:
    """A replica asking to train step ``step``.

    Attributes:
        replica: the replica group's id.
        step: the step the replica is about to train (its committed step count).
        failed_epoch: set when the replica's exchange in that epoch failed; forces a new epoch.
    """

    replica: int
    step: int
    failed_epoch: int | None = None


# granted_through while a previous coordinator's grants are not known (QuorumState.resume): any step.
UNKNOWN_GRANTS = 1 << 62


@dataclasses.dataclass(frozen=True)
class QuorumDecision:
    """Who trains step ``step`` together under ``epoch``.

    Attributes:
        epoch: strictly increasing across decisions that change membership.
        step: the step every member trains next (the newest step among the members).
        members: replica ids, sorted; a member's index is its rank in the exchange.
        behind: members that must first load the state of ``step`` from their donor.
        donors: behind replica -> the up-to-date replica that serves it.
    """

    epoch: int
    step: int
    members: tuple[int, ...]
    behind: tuple[int, ...] = ()
    donors: tuple[tuple[int, int], ...] = ()

    @property
    def contributing(self) -> int:
        """How many replicas contribute a gradient this step (behind ones send zeros)."""
        return len(self.members) - len(self.behind)

    @functools.cached_property
    def member_set(self) -> frozenset[int]:
        """The members as a set: asked about on every request, so not a scan of the tuple."""
        return frozenset(self.members)

    @functools.cached_property
    def behind_set(self) -> frozenset[int]:
        """The members catching up, as a set (who contributes is asked of every member)."""
        return frozenset(self.behind)

    def donor_of(self, replica: int) -> int | None:
        return self.donor_map.get(replica)

    @functools.cached_property
    def donor_map(self) -> dict[int, int]:
        """Behind replica -> its donor (read, never changed, by every answer of the decision)."""
        return dict(self.donors)

    @property
    def leader(self) -> int:
        """The member whose node hosts the rendezvous of this epoch's cross-replica groups
        (:meth:`unbroken.control.quorum.service.QuorumService.rendezvous`): turned with the
        epoch, so the epoch after one that failed (its leader's store unreachable) meets on
        another node, and no store serves every epoch of a long job."""
        return self.members[self.epoch % len(self.members)] if self.members else -1

    @functools.cached_property
    def stores(self) -> dict[int, str]:
        """Rank index -> the store its cross-replica group meets on ("": the coordinator's),
        chosen by whoever answers first, so every member of a group is told the same."""
        return {}

    @functools.cached_property
    def wire(self) -> dict[str, bytes]:
        """This decision's texts for the wire (:mod:`unbroken.control.protocol`), by what they
        are, filled by whoever answers first: a replica asking after the epoch formed gets them
        without encoding thousands of members again."""
        return {}

    def to_json(self) -> dict[str, object]:
        """The decision as sent to members: members and behind ones as runs of consecutive ids
        (:func:`member_runs`), so an answer's size follows the gaps, not the job's size (the
        coordinator sends each member only the donor pairs that name it: :meth:`donors_by_replica`).
        """
        return {
            "epoch": self.epoch,
            "step": self.step,
            "member_runs": member_runs(self.members),
            "behind_runs": member_runs(self.behind),
            "donors": [list(p) for p in self.donors],
        }

    def donors_by_replica(self) -> dict[int, list[list[int]]]:
        """Each replica named in a donor pair -> the pairs that name it (the one it fetches
        from, the ones it serves): all a member acts on. With most of 5,000 members behind,
        every pair to every member was 60 KB an answer. Made once per decision (not per
        answer: a replica answered alone would cost a pass over every pair); not to be changed."""
        return self._donor_pairs

    @functools.cached_property
    def _donor_pairs(self) -> dict[int, list[list[int]]]:
        by: dict[int, list[list[int]]] = {}
        for newcomer, donor in self.donors:
            by.setdefault(newcomer, []).append([newcomer, donor])
            by.setdefault(donor, []).append([newcomer, donor])
        return by

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QuorumDecision:
        """The decision in ``data`` (parsed JSON, so the caller checks its members' types):
        the wire's form (``member_runs``, ``behind_runs``) or the listed one the replica's
        client hands its training thread (``members``, ``behind``:
        :func:`unbroken.control.client.listed_decision`).

        Raises:
            ValueError: ``member_runs`` or ``behind_runs`` that are not increasing, disjoint
                pairs of ids, or more than :data:`MAX_MEMBERS` ids in all.
        """
        members = tuple(data["members"]) if "members" in data else members_of_runs(data["member_runs"])
        behind = tuple(data["behind"]) if "behind" in data else members_of_runs(data["behind_runs"])
        return cls(
            epoch=int(data["epoch"]),
            step=int(data["step"]),
            members=members,
            behind=behind,
            donors=tuple(tuple(p) for p in data["donors"]),
        )


@dataclasses.dataclass(frozen=True)
class QuorumRules:
    """Settings of the quorum rules.

    Attributes:
        total_replicas: how many replicas the job is configured with.
        min_replicas: the fewest replicas that may train.
        join_window_s: how long forming waits for replicas that are alive but have not asked.
        startup_window_s: how long the very first quorum waits for all replicas to arrive.
        max_members: the most replicas an epoch may have (None: every replica that asks); the
            others wait as hot spares.
    """

    total_replicas: int
    min_replicas: int = 1
    join_window_s: float = 1.0
    startup_window_s: float = 10.0
    max_members: int | None = None

    def __post_init__(self) -> None:
        if self.total_replicas < 1:
            raise ValueError(f"total_replicas must be >= 1, got {self.total_replicas}")
        if not 1 <= self.min_replicas <= self.total_replicas:
            raise ValueError(
                f"min_replicas must be between 1 and total_replicas ({self.total_replicas}), "
                f"got {self.min_replicas}"
            )
        if self.max_members is not None and not self.min_replicas <= self.max_members <= self.total_replicas:
            raise ValueError(
                f"max_members must be between min_replicas ({self.min_replicas}) and total_replicas "
                f"({self.total_replicas}), got {self.max_members}"
            )


class QuorumState:
    """Membership and epochs of one job.

    Args:
        rules: the settings.
        first_epoch: epochs issued start above this (a restarted coordinator passes the
            highest epoch it had persisted, so epochs keep growing across restarts).

    Attributes:
        epoch_limit: no epoch above this is formed (None: no limit); the coordinator sets it
            to what it has durably reserved, so an epoch is never issued before it is safe.
    """

    def __init__(self, rules: QuorumRules, first_epoch: int = 0) -> None:
        self.rules = rules
        self.epoch = first_epoch
        self.epoch_limit: int | None = None
        self.current: QuorumDecision | None = None
        self.alive: set[int] = set()
        self.waiting: dict[int, QuorumRequest] = {}
        # Hot spares: replicas left out of a full epoch, whose requests wait for a free place.
        self.parked: dict[int, QuorumRequest] = {}
        self.silent: set[int] = set()
        self.forming_since: float | None = None
        self.join_window_s = rules.join_window_s
        # The current epoch can no longer complete an exchange (a member failed or left).
        self.broken = False
        # The newest step a fast answer of the current epoch was granted through: fixed membership.
        self.granted_through = -1
        self._own_through = -1  # granted through by this coordinator (while a previous one's are not known)

    # -- events -------------------------------------------------------------------------

    def connect(self, replica: int) -> None:
        """A replica (all its ranks) is connected and heartbeating."""
        self.alive.add(replica)

    def disconnect(self, replica: int, now: float) -> list[QuorumDecision]:
        """A replica exited, closed its connection or stopped heartbeating."""
        self.alive.discard(replica)
        self.waiting.pop(replica, None)
        self.parked.pop(replica, None)
        if self.current is not None and replica in self.current.member_set:
            self.broken = True
            self._start_forming(now)
        elif not self.waiting and not self.broken:
            self.forming_since = None
        return self.evaluate(now)

    def set_silent(self, replicas: Iterable[int], now: float) -> list[QuorumDecision]:
        """Replicas alive but missing heartbeats: forming stops waiting for them."""
        self.silent = set(replicas)
        return self.evaluate(now)

    def request(self, req: QuorumRequest, now: float) -> tuple[QuorumDecision | None, list[QuorumDecision]]:
        """Handles a replica's quorum request.

        Returns:
            The immediate answer for the requester (fast path) or None if it must wait, and
            the decisions formed by this request (to be delivered to everyone waiting).
        """
        self.alive.add(req.replica)
        fast = self._fast_answer(req)
        if fast is not None:
            return fast, []
        cur = self.current
        if req.failed_epoch is not None and cur is not None and req.failed_epoch == cur.epoch:
            self.broken = True
        if cur is not None and self._full(cur) and req.replica not in cur.member_set:
            self.parked[req.replica] = req  # a hot spare: asked into a full epoch that trains on
            return None, []
        self.parked.pop(req.replica, None)
        self.waiting[req.replica] = req
        # A newcomer alone does not start the join window: the members are mid-step and
        # will ask when they finish it; the window counts from the first member that asks.
        if cur is None or self.broken or req.replica in cur.member_set:
            self._start_forming(now)
        return None, self.evaluate(now)

    def _full(self, cur: QuorumDecision | None) -> bool:
        """Whether ``cur`` is intact and has as many members as an epoch may have."""
        cap = self.rules.max_members
        return cap is not None and cur is not None and not self.broken and len(cur.members) >= cap

    def _spares(self) -> dict[int, int]:
        """The parked replicas that could join an epoch forming now (alive, heard): id -> step."""
        return {r: q.step for r, q in self.parked.items() if r in self.alive and r not in self.silent}

    def _fast_answer(self, req: QuorumRequest) -> QuorumDecision | None:
        cur = self.current
        if (
            cur is None
            or self.broken
            or req.failed_epoch is not None
            or req.replica not in cur.member_set
            or req.step < cur.step
        ):
            return None
        if req.step > cur.step:
            if self.waiting and req.step > self.granted_through:
                return None  # a newcomer waits: admit it at this new step (no step granted fixes it)
            self.current = dataclasses.replace(cur, step=req.step, behind=(), donors=())
            # The same epoch's groups: the stores its members were told go on (QuorumDecision.stores).
            self.current.__dict__["stores"] = cur.stores
        return self.current

    def grant(self, replica: int, step: int, steps: int) -> int:
        """The last step the fast answer to ``replica`` for ``step`` stands for (``step``: no
        grant), given :func:`~unbroken.control.quorum.grants.grant_steps` ``steps``; recorded, so that
        no newcomer is admitted before it. No grant while a newcomer waits (it is admitted at the
        next step asked for past the ones granted) or the epoch is broken."""
        if self.waiting or self.broken or self.current is None or steps <= 1:
            return step
        through = grant_through(replica, step, steps)
        self.granted_through = max(self.granted_through, through)
        self._own_through = max(self._own_through, through)
        return through

    def lift_grants(self) -> None:
        """Every grant of the coordinator before this one has run out (``max_grant_s`` after
        :meth:`resume`): newcomers are admitted past the steps this one granted only."""
        if self.granted_through == UNKNOWN_GRANTS:
            self.granted_through = self._own_through

    def upcoming_donors(self) -> dict[int, int]:
        """Which member will most likely serve each newcomer now waiting to be admitted.

        A newcomer asks while the members are mid-step, so it is admitted at their next step,
        with donors assigned as :meth:`_form` will assign them. Told in advance, a donor can
        snapshot its state when that step starts and serve it during the step's compute,
        instead of after it. Only a forecast: the decision that forms is what counts.
        """
        cur = self.current
        if cur is None or self.broken:
            return {}
        newcomers = sorted(r for r in self.waiting if r not in cur.member_set)
        if not newcomers:
            return {}  # asked on every request: no scan of the members unless someone waits
        ahead = [m for m in cur.members if m in self.alive and m not in self.silent]
        if not ahead:
            return {}
        return {b: ahead[i % len(ahead)] for i, b in enumerate(newcomers)}

    def upcoming_epoch(self) -> QuorumDecision | None:
        """The epoch that forms when the newcomers now waiting are admitted at the members' next
        step, if nothing else changes (every member alive, none silent); None when none waits
        or no such forecast holds. Its members build its groups ahead
        (:class:`unbroken.control.protocol.Prepare`); only the decision that forms counts."""
        cur = self.current
        if cur is None or self.broken:
            return None
        newcomers = [r for r in self.waiting if r not in cur.member_set]
        if not newcomers or any(m not in self.alive or m in self.silent for m in cur.members):
            return None
        steps = {m: 1 for m in cur.members} | {r: 0 for r in newcomers}  # members are ahead
        cap = self.rules.max_members
        chosen = choose_members(steps, cur.member_set, cap) if cap is not None and len(steps) > cap else set(steps)
        members = tuple(sorted(chosen))
        if members == cur.members:
            return None  # every newcomer would be parked
        return QuorumDecision(self.epoch + 1, 0, members, ())

    def in_flight_members(self) -> tuple[int, ...]:
        """Members of a broken epoch that may still be blocked in its exchange."""
        if self.current is None or not self.broken:
            return ()
        return tuple(m for m in self.current.members if m in self.alive and m not in self.waiting)

    # -- rules --------------------------------------------------------------------------

    def evaluate(self, now: float) -> list[QuorumDecision]:
        """Forms a quorum if the rules allow; called on every event and on a timer."""
        if self.forming_since is None or not self.waiting:
            return []
        if self.epoch_limit is not None and self.epoch >= self.epoch_limit:
            return []  # not reserved on disk yet: forming waits for the reservation
        waited = now - self.forming_since
        # Called on every request while an epoch forms: counting first keeps it O(1) until the
        # last replica asks, instead of comparing sets of thousands of replicas each time.
        if self.current is None:
            if len(self.waiting) < self.rules.total_replicas and waited < self.rules.startup_window_s:
                return []
        elif len(self.waiting) < len(self.alive) - len(self.silent) - len(self.parked) and waited < self.join_window_s:
            return []
        asked = set(self.waiting) & self.alive
        everyone_asked = self.alive - self.silent - self.parked.keys() <= asked
        if self.current is None:
            ready = (everyone_asked and len(asked) >= self.rules.total_replicas) or (
                waited >= self.rules.startup_window_s
            )
        else:
            ready = everyone_asked or waited >= self.join_window_s
        spares = self._spares()
        if not ready or not majority_ok(asked | spares.keys(), self.alive, self.rules.min_replicas):
            return []
        return [self._form({**spares, **{m: self.waiting[m].step for m in asked}})]

    def push(self, heard: Mapping[int, int]) -> QuorumDecision | None:
        """Forms the next epoch now that the current one is broken, without waiting for re-asks.

        Waiting for every survivor to notice the abort and ask again cost a round trip per
        member through the coordinator's one loop (8.7 s from a death to the new epoch at 5,000
        groups); the answers are known already. Its members: the replicas that asked, and the
        members of the broken epoch that have not (``heard``: member -> the step it trains, as
        last said) and are alive and not silent: one catching up at most at the broken epoch's
        step, every other one at the newest step its peers are known to train (within the grant).
        The same rules as :meth:`evaluate`: a strict majority of the live replicas,
        ``min_replicas``, an epoch within :attr:`epoch_limit`.

        Returns:
            The decision, or None when there is nothing to push (no broken epoch) or the rules
            do not allow it yet (the members then re-ask as before).
        """
        cur = self.current
        if cur is None or not self.broken:
            return None
        if self.epoch_limit is not None and self.epoch >= self.epoch_limit:
            return None
        steps = {m: r.step for m, r in self.waiting.items() if m in self.alive}
        in_flight = {
            m: step
            for m, step in heard.items()
            if m in cur.member_set and m in self.alive and m not in self.silent and m not in steps
        }
        # Members not catching up train in lock step (each step's exchange holds them together):
        # the newest step any of them is known to train is everyone's. Under a grant that is past
        # the epoch's step (a member says it in its heartbeats), never past the grant.
        newest = max(cur.step, self.granted_through)
        at = max(
            [cur.step]
            + [min(s, newest) for m, s in in_flight.items() if m not in cur.behind_set]
            + [s for m, s in steps.items() if m in cur.member_set and m not in cur.behind_set]
        )
        for m, step in in_flight.items():
            steps[m] = min(step, cur.step) if m in cur.behind_set else at
        steps = {**self._spares(), **steps}
        if not majority_ok(steps, self.alive, self.rules.min_replicas):
            return None
        return self._form(steps)

    def resume(self, d: QuorumDecision) -> None:
        """Continues ``d``, the epoch a previous coordinator issued last, as the current one
        (:mod:`unbroken.control.quorum.resume`): its members are counted alive until they are back or
        given up on, and asking for their next step they are answered at once, in ``d``, instead
        of forming a first epoch that every replica rebuilds its group for. Epochs formed from
        here on are still numbered above :attr:`epoch` (what the previous one may have issued)."""
        self.current = d
        self.alive |= d.member_set
        self.broken = False
        # The previous coordinator's grants may stand (a node's relay keeps them across a takeover):
        # how far is not known, so no newcomer is admitted until they have run out (lift_grants).
        self.granted_through = UNKNOWN_GRANTS
        self._own_through = -1
        self.forming_since = None

    def abandon(self, alive: Iterable[int], now: float) -> None:
        """Gives up the resumed epoch (someone trains in another one): the next epoch forms as
        a first one, from every replica in ``alive`` (those connected) that asks."""
        self.current = None
        self.alive = set(alive)
        self.waiting.update({r: q for r, q in self.parked.items() if r not in self.waiting})
        self.parked.clear()
        self.broken = False
        self.granted_through = self._own_through = -1
        self.forming_since = now if self.waiting else None

    def _form(self, steps: dict[int, int]) -> QuorumDecision:
        """The next epoch of the replicas in ``steps`` (replica -> the step it is at), at most
        ``max_members`` of them (:func:`choose_members`); the others are parked."""
        cap = self.rules.max_members
        if cap is not None and len(steps) > cap:
            before = self.current.member_set if self.current is not None else frozenset()
            chosen = choose_members(steps, before, cap)
            for r in steps.keys() - chosen:
                self.parked[r] = self.waiting.get(r) or self.parked.get(r) or QuorumRequest(r, steps[r])
            steps = {m: steps[m] for m in chosen}
        for m in steps:
            self.parked.pop(m, None)
        members = tuple(sorted(steps))
        step = max(steps.values())
        behind = tuple(m for m in members if steps[m] < step)
        self.epoch += 1
        self.current = decision(self.epoch, step, members, behind)
        self.broken = False
        self.granted_through = self._own_through = -1
        self.waiting.clear()
        self.forming_since = None
        return self.current

    def _start_forming(self, now: float) -> None:
        if self.forming_since is None:
            self.forming_since = now


def choose_members(steps: Mapping[int, int], before: Iterable[int], cap: int) -> set[int]:
    """The ``cap`` replicas of ``steps`` (replica -> its step) an epoch takes: the members of the
    epoch ``before`` first (a spare never displaces a replica that trains), then the furthest
    along (the least to catch up), then the lowest ids (at the start: the configured replicas,
    not the spares started after them)."""
    was = set(before)
    return set(sorted(steps, key=lambda r: (r not in was, -steps[r], r))[:cap])


def decision(epoch: int, step: int, members: tuple[int, ...], behind: tuple[int, ...]) -> QuorumDecision:
    """The decision of ``epoch``: each member in ``behind`` is served by an up-to-date one, in
    turn (a decision read back from the history gets the donors it was formed with)."""
    behind_set = set(behind)
    ahead = [m for m in members if m not in behind_set]
    donors = tuple((b, ahead[i % len(ahead)]) for i, b in enumerate(behind)) if ahead else ()
    return QuorumDecision(epoch, step, members, behind, donors)


#: The most members a decision may list: far above any job (replica groups, not GPUs), and a
#: bound on what a pair of numbers on the wire can make a member allocate.
MAX_MEMBERS = 1 << 20


def member_runs(members: Iterable[int]) -> list[list[int]]:
    """Sorted replica ids as ``[first, last]`` runs of consecutive ids.

    A full quorum answer goes to every member once per epoch: at 1,000 groups a list of ids was
    5 KB per answer, 5 MB per epoch through the coordinator's one loop, when the membership of a
    job with one group missing is two runs.
    """
    runs: list[list[int]] = []
    for m in members:
        if runs and m == runs[-1][1] + 1:
            runs[-1][1] = m
        else:
            runs.append([m, m])
    return runs


def members_of_runs(runs: Any) -> tuple[int, ...]:
    """The ids of :func:`member_runs` ``runs``, checked: ValueError unless they are increasing,
    disjoint ``[first, last]`` pairs of non-negative integers, :data:`MAX_MEMBERS` at most."""
    if not isinstance(runs, list):
        raise ValueError(f"member_runs must be a list, got {runs!r:.40}")
    members: list[int] = []
    after = -1
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(type(x) is int for x in run)
            or not after < run[0] <= run[1]
        ):
            raise ValueError(f"member_runs must be increasing, disjoint [first, last] id pairs, got {run!r:.40}")
        if len(members) + run[1] - run[0] + 1 > MAX_MEMBERS:
            raise ValueError(f"member_runs name more than {MAX_MEMBERS} members")
        members.extend(range(run[0], run[1] + 1))
        after = run[1]
    return tuple(members)


def push_answers(d: QuorumDecision, replica: int, step: int, failed_epoch: int | None) -> bool:
    """Whether a pushed decision ``d`` is the answer to ``replica``'s request (``step``, after
    ``failed_epoch``): the one the coordinator would have given it had it asked.

    It names the replica, is newer than the epoch the request says failed, and trains the step
    asked for, or a later one the replica catches up to (it is behind in ``d``). Anything else
    (a step it moved past, an epoch it already failed in) is asked for as usual.
    """
    if replica not in d.member_set or (failed_epoch is not None and failed_epoch >= d.epoch):
        return False
    return step == d.step or (replica in d.behind_set and step <= d.step)


def majority_ok(asked: Iterable[int], alive: Iterable[int], min_replicas: int) -> bool:
    """Whether ``asked`` may train: enough replicas and a strict majority of the live ones."""
    a, b = set(asked), set(alive)
    return len(a) >= min_replicas and 2 * len(a) > len(b)
