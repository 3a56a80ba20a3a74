"""A restarted coordinator (or a standby that took over) continues the job's epoch.

What a job relies on: members that say the epoch they train in are answered in it at once, each
as its ranks ask, with no epoch formed (no group rebuilt) and no waiting for the others; a member
that cannot be in it (a restarted process, a newer epoch the history missed) ends it, the ranks
answered in it are told to abort, and a new epoch forms; a member that never comes back is evicted
and the epoch pushed without it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.live_coordinator import live_coordinator, member, next_op
from unbroken.control import protocol
from unbroken.control.quorum.resume import Claim, ResumedEpoch
from unbroken.control.quorum.rules import decision
from unbroken.wire.auth import JobSecret

SETTINGS: dict[str, Any] = {"total_replicas": 3, "join_window_floor_s": 0.3}


def test_a_member_saying_the_epoch_continues_it_and_anything_else_ends_it() -> None:
    r = ResumedEpoch(decision(7, 40, (0, 1, 2), (2,)), until=10.0)
    assert r.decision.donors == ((2, 0),)  # as it was formed: the behind one's donor is the first ahead
    assert r.claim(0, 7) is Claim.MEMBER
    assert r.claim(1, None) is Claim.CONFLICT  # a process that restarted holds no group of epoch 7
    assert r.claim(1, 6) is Claim.CONFLICT  # never told epoch 7: it cannot join its group now
    assert r.claim(3, 5) is Claim.NEWCOMER and r.claim(3, None) is Claim.NEWCOMER
    assert r.claim(3, 8) is Claim.CONFLICT  # an epoch the history does not have: it is behind
    r.back |= {0, 1}
    assert r.overdue(9.9) == [] and r.overdue(10.0) == [2] and not r.complete
    r.back.add(2)
    assert r.complete


async def ask(link: protocol.Link, req_id: int, step: int, failed: int | None = None) -> None:
    link.send(protocol.QuorumAsk(id=req_id, step=step, step_time=None, failed_epoch=failed).to_msg())


async def answer(link: protocol.Link) -> dict[str, Any]:
    return (await next_op(link, "quorum"))["decision"]


async def first_run(state_dir: Path, secret: JobSecret) -> int:
    """A coordinator that formed one epoch of the three replicas and saw them train to step 3."""
    async with live_coordinator(state_dir, secret, **SETTINGS) as c:
        links = [await member(c, secret, r) for r in range(3)]
        for step in range(4):
            for link in links:
                await ask(link, step + 1, step)
            said = [await next_op(link, "quorum") for link in links]
            epochs = {m["same_epoch"] if "same_epoch" in m else m["decision"]["epoch"] for m in said}
        for link in links:
            link.close()
    (epoch,) = epochs
    return epoch


def events(state_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (state_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


async def _members_trained_on(tmp: Path) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]], int]:
    secret = JobSecret.generate()
    epoch = await first_run(tmp, secret)
    async with live_coordinator(tmp, secret, **SETTINGS) as c:
        first = [await member(c, secret, r, epoch=epoch) for r in (0, 1)]
        for link in first:
            await ask(link, 9, 4)
        early = [await answer(link) for link in first]  # replica 2 is not back yet: nobody waits for it
        late = await member(c, secret, 2, epoch=epoch)
        await ask(late, 9, 4)
        early.append(await answer(late))
        for link in [*first, late]:
            await ask(link, 10, 5)
        short = [await next_op(link, "quorum") for link in [*first, late]]
        formed = c.quorum.epoch
        for link in [*first, late]:
            link.close()
    return epoch, early, short, formed


def test_members_train_on_in_the_epoch_they_trained_in(tmp_path: Path) -> None:
    epoch, early, short, formed = asyncio.run(_members_trained_on(tmp_path))
    assert [(d["epoch"], d["step"], d["member_runs"]) for d in early] == [(epoch, 4, [[0, 2]])] * 3
    assert [m.get("same_epoch") for m in short] == [epoch] * 3  # the fast path, as before the restart
    assert formed > epoch  # new epochs (none formed here) stay above any the first one may have issued
    resumed = events(tmp_path, "epoch_resumed")
    assert [(e["epoch"], e["members"]) for e in resumed] == [(epoch, [0, 1, 2])]
    assert not [q for q in events(tmp_path, "quorum") if q["t"] > resumed[0]["t"]]  # no group rebuilt


async def _a_restarted_member_ends_it(tmp: Path) -> tuple[int, list[dict[str, Any]]]:
    secret = JobSecret.generate()
    epoch = await first_run(tmp, secret)
    async with live_coordinator(tmp, secret, **SETTINGS) as c:
        on = await member(c, secret, 0, epoch=epoch)
        await ask(on, 1, 4)
        resumed = await answer(on)
        restarted = await member(c, secret, 1)  # a new process: no epoch
        abort = await next_op(on, "abort")
        other = await member(c, secret, 2, epoch=epoch)
        await ask(on, 2, 4, failed=epoch)
        await ask(restarted, 1, 2)  # from its checkpoint
        await ask(other, 1, 4)
        new = [await answer(link) for link in (on, restarted, other)]
        for link in (on, restarted, other):
            link.close()
    return epoch, [resumed, abort, *new]


def test_a_member_that_restarted_ends_the_epoch_and_a_new_one_forms(tmp_path: Path) -> None:
    epoch, (resumed, abort, *new) = asyncio.run(_a_restarted_member_ends_it(tmp_path))
    assert [(e["epoch"], e["replica"], e.get("said")) for e in events(tmp_path, "resume_given_up")] == [
        (epoch, 1, None)
    ]
    assert resumed["epoch"] == epoch and abort["epoch"] == epoch  # answered in it, then told to leave it
    assert len({d["epoch"] for d in new}) == 1 and new[0]["epoch"] > epoch
    assert new[0]["member_runs"] == [[0, 2]] and new[0]["behind_runs"] == [[1, 1]] and new[0]["step"] == 4


async def _a_member_not_back_is_evicted(tmp: Path) -> tuple[int, list[dict[str, Any]]]:
    secret = JobSecret.generate()
    epoch = await first_run(tmp, secret)
    async with live_coordinator(tmp, secret, startup_window_s=0.5, **SETTINGS) as c:
        links = [await member(c, secret, r, epoch=epoch) for r in (0, 1)]
        for link in links:
            await ask(link, 1, 4)
        got = [await answer(link) for link in links]
        pushed = [await next_op(link, "epoch", timeout=5.0) for link in links]  # replica 2 never came back
        for link in links:
            link.close()
    return epoch, [*got, *pushed]


def test_a_member_not_back_in_time_is_evicted_and_the_epoch_pushed_without_it(tmp_path: Path) -> None:
    epoch, (a, b, push_a, push_b) = asyncio.run(_a_member_not_back_is_evicted(tmp_path))
    assert a["epoch"] == b["epoch"] == epoch
    assert push_a["abort"] == push_b["abort"] == epoch
    assert push_a["decision"]["epoch"] > epoch and push_a["decision"]["member_runs"] == [[0, 1]]
