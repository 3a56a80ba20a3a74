"""Which samples each replica trains at each step, and an exact account across membership changes.

A job of ``R`` configured replicas trains ``R`` *slots* per step; slot ``r`` of step ``s`` is the
``samples_per_replica`` sample ids starting at ``(s * R + r) * samples_per_replica``, so a
fault-free run reads the sample ids 0, 1, 2, ... in order. Who trains which slot is a pure
function of (step, configured replicas, contributing replicas), :func:`plan_step`, so every
replica computes the same plan from the step's quorum decision and a job can say afterwards
exactly which samples were trained on. Two policies:

``skip``
    A replica that does not contribute to a step (dead, hung, or catching up) leaves its slot
    untrained; the slot is counted in ``samples_skipped``. The batch shrinks while replicas are
    missing (what unbroken did before; ``unbroken.Optimizer`` then scales the learning rate).
``constant_global_batch``
    The contributing replicas take over the missing replicas' slots as extra micro-batches
    (gradient accumulation), so every step trains the same samples, in the same order, as a
    fault-free run: ``samples_skipped`` and ``samples_repeated`` stay 0. Each micro-batch's loss
    is scaled by ``contributing / slots`` so that the cross-replica average over the
    contributors equals the fault-free mean over all slots. A step whose exchange fails is
    redone by the loop with the plan of the next quorum (``manager.redo_failed_steps``), never
    with gradients computed for the old one.

Inside a replica, each of its ``world_size`` ranks takes an equal contiguous part of every slot.
The account (:class:`SampleAccount`) is part of the replica's registered state, so a replica that
catches up or resumes continues it. Loop shape (:class:`ReplicaBatches` binds it to a manager)::

    batches = ReplicaBatches(manager, samples_per_replica=16, policy="constant_global_batch")
    manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)
    while manager.step < steps:
        manager.start_step()
        plan = batches.plan()                      # waits for the step's quorum
        for i, ids in enumerate(plan.micro_batches):
            loss = loss_of(dataset[ids]) * plan.loss_scale
            loss.backward()
        if manager.sync_gradients(grads):
            optimizer.step(); manager.commit(); batches.commit(plan)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.control.quorum.rules import QuorumDecision
    from unbroken.train.manager import Manager

SKIP = "skip"
CONSTANT_GLOBAL_BATCH = "constant_global_batch"
POLICIES = (SKIP, CONSTANT_GLOBAL_BATCH)


def slot_samples(step: int, slot: int, num_replicas: int, samples_per_replica: int) -> range:
    """The sample ids of slot ``slot`` of step ``step`` (what replica ``slot`` trains without faults)."""
    start = (step * num_replicas + slot) * samples_per_replica
    return range(start, start + samples_per_replica)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Who trains which slots of one step.

    Attributes:
        step: the step.
        slots: contributing replica -> the slots it trains, in order (one micro-batch each).
        skipped: slots nobody trains this step.
        loss_scale: what each micro-batch's loss is multiplied by, so that unbroken's average
            over the contributing replicas is the mean over the trained slots.
    """

    step: int
    slots: dict[int, tuple[int, ...]]
    skipped: tuple[int, ...]
    loss_scale: float

    @property
    def trained(self) -> int:
        return sum(len(s) for s in self.slots.values())


def plan_step(step: int, num_replicas: int, contributing: Iterable[int], policy: str) -> StepPlan:
    """Which slots each contributing replica trains at ``step`` (pure; every replica agrees).

    A contributing replica ``c < num_replicas`` trains its own slot ``c``; a contributing spare
    (an id of ``num_replicas`` or more) takes the lowest slot nobody owns. Under ``skip`` the
    remaining slots are skipped; under ``constant_global_batch`` they are dealt round-robin, in
    slot order, to the contributing replicas in id order.

    Raises:
        ValueError: an unknown policy, a step below 0, no configured replica, or no contributor.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown data policy {policy!r}: use one of {', '.join(POLICIES)}")
    if step < 0 or num_replicas < 1:
        raise ValueError(f"need step >= 0 and num_replicas >= 1, got step={step}, num_replicas={num_replicas}")
    members = sorted(set(contributing))
    if not members:
        raise ValueError(f"step {step}: no contributing replica, nothing to plan")
    slots: dict[int, list[int]] = {c: [c] if c < num_replicas else [] for c in members}
    orphans = [s for s in range(num_replicas) if s not in slots]
    for c in members:
        if not slots[c] and orphans:
            slots[c].append(orphans.pop(0))
    skipped: list[int] = []
    if policy == SKIP:
        skipped = orphans
    else:
        for i, s in enumerate(orphans):
            slots[members[i % len(members)]].append(s)
    for c in members:
        slots[c].sort()
    trained = sum(len(v) for v in slots.values())
    return StepPlan(step, {c: tuple(v) for c, v in slots.items()}, tuple(skipped), len(members) / trained)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What one rank trains at one step: its part of each of its replica's slots.

    Attributes:
        step: the step.
        micro_batches: sample ids per micro-batch (one per slot of its replica, in slot order);
            empty when the replica does not contribute (it is catching up).
        loss_scale: the factor for each micro-batch's (mean) loss.
        plan: the step's plan for all replicas.
    """

    step: int
    micro_batches: tuple[tuple[int, ...], ...]
    loss_scale: float
    plan: StepPlan


def rank_plan(
    plan: StepPlan, replica: int, rank: int, world_size: int, num_replicas: int, samples_per_replica: int
) -> RankPlan:
    """Rank ``rank`` of ``world_size`` takes the ``rank``-th contiguous part of each slot."""
    if samples_per_replica % world_size:
        raise ValueError(
            f"samples_per_replica ({samples_per_replica}) must be a multiple of the ranks per "
            f"replica ({world_size}): each rank takes an equal part of every slot"
        )
    per_rank = samples_per_replica // world_size
    micro = []
    for slot in plan.slots.get(replica, ()):
        ids = slot_samples(plan.step, slot, num_replicas, samples_per_replica)
        micro.append(tuple(ids[rank * per_rank : (rank + 1) * per_rank]))
    return RankPlan(plan.step, tuple(micro), plan.loss_scale, plan)


def contributing_of(decision: QuorumDecision) -> tuple[int, ...]:
    """The replicas whose gradient a step's exchange averages: members not catching up."""
    return tuple(m for m in decision.members if m not in decision.behind_set)


class SampleAccount:
    """The job-wide count of trained, skipped and repeated samples (the same on every replica).

    ``samples_repeated`` counts samples trained a second time because a replica's state went
    back to an earlier step than one this account already committed (a rollback, or a loaded
    checkpoint older than the state it replaces); under both policies a step's plan itself
    never repeats a sample. A fresh process that resumes from a checkpoint knows only the
    checkpoint's account: the per-step record of the consumed ids (``record`` in
    :meth:`commit`) is the complete history.
    """

    def __init__(self, num_replicas: int, samples_per_replica: int, policy: str = CONSTANT_GLOBAL_BATCH) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown data policy {policy!r}: use one of {', '.join(POLICIES)}")
        if num_replicas < 1 or samples_per_replica < 1:
            raise ValueError(
                f"need num_replicas >= 1 and samples_per_replica >= 1, got {num_replicas}, " f"{samples_per_replica}"
            )
        self.num_replicas = num_replicas
        self.samples_per_replica = samples_per_replica
        self.policy = policy
        self.next_step = 0  # the step after the last one committed
        self.high_water = 0  # the highest next_step this account has seen, committed or loaded
        self.samples_trained = 0
        self.samples_skipped = 0
        self.samples_repeated = 0

    def plan(self, step: int, contributing: Iterable[int]) -> StepPlan:
        return plan_step(step, self.num_replicas, contributing, self.policy)

    def commit(self, plan: StepPlan, contributing: Iterable[int] | None = None) -> None:
        """Counts a committed step. ``contributing``: the replicas the committed exchange really
        averaged, if that may differ from the plan's (their slots are then counted skipped)."""
        trained = plan.trained
        skipped = len(plan.skipped)
        if contributing is not None:
            lost = [c for c in plan.slots if c not in set(contributing)]
            lost_slots = sum(len(plan.slots[c]) for c in lost)
            trained -= lost_slots
            skipped += lost_slots
        n = self.samples_per_replica
        self.samples_trained += trained * n
        self.samples_skipped += skipped * n
        if plan.step < self.high_water:
            self.samples_repeated += trained * n
        self.next_step = plan.step + 1
        self.high_water = max(self.high_water, self.next_step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "num_replicas": self.num_replicas,
            "samples_per_replica": self.samples_per_replica,
            "next_step": self.next_step,
            "high_water": self.high_water,
            "samples_trained": self.samples_trained,
            "samples_skipped": self.samples_skipped,
            "samples_repeated": self.samples_repeated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a peer's or a checkpoint's account; one of another data layout is refused."""
        theirs = (state["policy"], int(state["num_replicas"]), int(state["samples_per_replica"]))
        ours = (self.policy, self.num_replicas, self.samples_per_replica)
        if theirs != ours:
            raise ValueError(
                f"the loaded data account has (policy, replicas, samples_per_replica) = {theirs} but "
                f"this job is configured with {ours}: its sample order would not continue"
            )
        high_water = max(self.high_water, int(state["high_water"]))
        # The loaded counts are the job's; only a step this process already went past is new knowledge.
        self.next_step = int(state["next_step"])
        self.samples_trained = int(state["samples_trained"])
        self.samples_skipped = int(state["samples_skipped"])
        self.samples_repeated = int(state["samples_repeated"])
        self.high_water = high_water


class ReplicaBatches:
    """:class:`SampleAccount` bound to a :class:`~unbroken.train.manager.Manager`: this rank's
    micro-batches of each step, from the step's quorum decision.

    Under ``constant_global_batch`` it sets ``manager.redo_failed_steps`` (a failed exchange is
    redone by the loop with a new plan) and turns the manager's learning-rate scaling off (the
    global batch does not shrink while replicas are missing).
    """

    def __init__(self, manager: Manager, samples_per_replica: int, policy: str = CONSTANT_GLOBAL_BATCH) -> None:
        self.manager = manager
        c = manager.config
        self.account = SampleAccount(c.num_replicas, samples_per_replica, policy)
        self._check = rank_plan(
            plan_step(0, c.num_replicas, [c.replica_id], policy),
            c.replica_id,
            c.rank,
            c.world_size,
            c.num_replicas,
            samples_per_replica,
        )  # fails early on bad sizes
        if policy == CONSTANT_GLOBAL_BATCH:
            manager.redo_failed_steps = True
            if c.lr_scaling:
                manager.config = dataclasses.replace(c, lr_scaling=False)

    def plan(self) -> RankPlan:
        """This rank's micro-batches of the current step (waits for the step's quorum)."""
        d = self.manager.wait_quorum()
        c = self.manager.config
        plan = self.account.plan(d.step, contributing_of(d))
        return rank_plan(plan, c.replica_id, c.rank, c.world_size, c.num_replicas, self.account.samples_per_replica)

    def commit(self, plan: RankPlan) -> None:
        """Counts a committed step (call after ``manager.commit()``)."""
        d = self.manager.decision
        self.account.commit(plan.plan, contributing_of(d) if d is not None and d.step == plan.step else None)

    def state_dict(self) -> dict[str, Any]:
        return self.account.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.account.load_state_dict(state)
