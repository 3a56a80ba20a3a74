"""The worker-side faults: what a rank does to its own training, and how it learns of them."""

from __future__ import annotations

import math
import time

import pytest

from unbroken import config as env
from unbroken.faults.schedule import Fault, Schedule, ScheduleError, parse_flag
from unbroken.faults.worker_chaos import WorkerChaos, chaos_env


def test_worker_hook_reaches_the_worker_through_its_environment() -> None:
    faults = Schedule.build(flags=["slow_rank:replica=1,factor=3,step=2"]).worker_faults(1, 0)
    environ = chaos_env(faults, job_start=123.0)
    hook = WorkerChaos.from_env(1, environ)
    assert hook is not None and hook.faults == faults and hook.job_start == 123.0
    assert WorkerChaos.from_env(1, {}) is None
    assert chaos_env([], 0.0) == {}
    with pytest.raises(ScheduleError, match=env.ENV_CHAOS):
        WorkerChaos.from_env(1, {env.ENV_CHAOS: "{not json"})


def test_slow_rank_sleeps_factor_minus_one_times_its_compute() -> None:
    slept: list[float] = []
    hook = WorkerChaos([parse_flag("slow_rank:replica=0,factor=3,step=2")], 0, time.time(), sleep=slept.append)
    for step in range(4):
        hook.start_step(step)
        time.sleep(0.02)
        hook.before_exchange(step, [0, 1], 1000)
        hook.before_exchange(step, [0, 1], 1000)  # a retried exchange is not slowed twice
    assert len(slept) == 2  # steps 2 and 3
    assert all(0.035 <= s <= 0.2 for s in slept), slept


def test_slow_link_delays_only_when_both_ends_are_members() -> None:
    slept: list[float] = []
    hook = WorkerChaos([parse_flag("slow_link:link=0-2,mb_s=10,step=0")], 0, time.time(), sleep=slept.append)
    hook.before_exchange(0, [0, 1], 1_000_000)
    assert slept == []
    hook.before_exchange(1, [0, 1, 2], 1_000_000)
    assert slept == [pytest.approx(0.1)]


def test_nan_loss_is_one_bad_step_unless_it_has_a_duration() -> None:
    import torch

    hook = WorkerChaos([parse_flag("nan_loss:replica=0,step=3,poison_grads=true")], 0, time.time())
    assert hook.loss(1.5, 2) == 1.5
    assert math.isnan(hook.loss(1.5, 3))
    g = torch.ones(3)
    hook.before_exchange(3, [0], 12, [g])
    assert torch.isnan(g).all()
    assert hook.loss(1.5, 4) == 1.5
    lasting = WorkerChaos([Fault("nan_loss", step=1, replica=0, duration_s=60)], 0, time.time())
    assert math.isnan(lasting.loss(1.0, 1)) and math.isnan(lasting.loss(1.0, 5))
