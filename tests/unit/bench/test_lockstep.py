"""The exchange's hold on simulated groups (:mod:`unbroken.bench.training.lockstep`): no group asks for a
step before every training group, in every client process, was answered for the one before."""

from __future__ import annotations

import asyncio

from unbroken.bench.training.lockstep import Lockstep


async def _held_until_the_last_group_is_answered() -> tuple[bool, bool, bool, bool]:
    floors = [0, 0]  # two client processes' slots
    here, there = Lockstep(floors, 0), Lockstep(floors, 1)
    for g in (0, 1):
        here.join(g, -1)
    there.join(2, -1)
    for g in (0, 1):
        here.answered(g, 4)  # a grant answered these two for step 4...
    early = await here.reached(4, timeout=0.05)  # ...but group 2, elsewhere, waits for its answer
    waiting = asyncio.create_task(here.reached(4, timeout=5.0))
    await asyncio.sleep(0.01)
    there.answered(2, 4)
    released = await waiting
    there.leave(2)  # out of the job (the victim): it holds nobody back
    here.answered(0, 5)
    here.answered(1, 5)
    gone = await here.reached(5, timeout=0.05)
    return early, released, gone, floors[1] > 1 << 60


def test_a_group_waits_for_every_group_of_every_process_and_never_for_one_out_of_the_job() -> None:
    early, released, gone, empty = asyncio.run(_held_until_the_last_group_is_answered())
    assert not early and released and gone and empty


def test_an_answer_for_an_older_step_moves_nothing() -> None:
    floors = [0]
    hold = Lockstep(floors, 0)
    hold.join(7, -1)
    hold.answered(7, 3)
    hold.answered(7, 2)  # a late duplicate
    hold.answered(8, 9)  # a group that never joined (left the job) is not counted
    assert floors == [3] and hold.last == {7: 3}
