"""The figures of ``unbroken bench torchtitan``, from torchtitan's own log lines (no processes)."""

from __future__ import annotations

import datetime

import pytest

from unbroken.bench.training.titan_trainer import (
    Start,
    full_strength_s,
    judge,
    stall_s,
    steady_step_s,
    step_times,
    summarize,
)

T0 = datetime.datetime(2026, 11, 29, 10, 0, 0).timestamp()


def line(t: float, step: int) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    # torchtitan colours its metrics line
    return f"[titan] {stamp} - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss:  0.37753  \x1b[39m\n"


def log(points: list[tuple[float, int]]) -> str:
    return "noise without a step\n" + "".join(line(t, s) for t, s in points)


def test_step_lines_are_read_through_the_colours() -> None:
    other = "[titan] 2026-11-29 10:00:01,000 - root - INFO - Training starts at step 1\n"
    got = step_times(log([(0.0, 1), (0.5, 2)]) + other)
    assert [s for _, s in got] == [1, 2]
    assert got[1][0] - got[0][0] == pytest.approx(0.5, abs=1e-3)


def test_the_fault_costs_the_gaps_over_twice_a_step_less_one_step() -> None:
    survivor = [(float(i) * 0.5, i) for i in range(1, 11)] + [(8.0, 11), (8.5, 12)]  # 3 s pause at the fault
    fault = 5.2
    step = steady_step_s(survivor, fault)
    assert step == pytest.approx(0.5)
    assert stall_s(survivor, fault, step) == pytest.approx(8.0 - 5.0 - 0.5)
    assert stall_s(survivor[:10], fault, step) == 0.0  # no pause after the fault: nothing lost


def test_full_strength_is_the_victims_first_step_in_line_with_the_survivors() -> None:
    survivors = [[(float(i), i) for i in range(1, 30)]]
    victim = [(1.0, 1), (2.0, 2), (12.0, 1), (13.5, 13), (14.0, 14)]  # restarted: step 1, then caught up
    assert full_strength_s(victim, survivors, fault_t=2.5) == pytest.approx(13.5 - 2.5)
    assert full_strength_s(victim[:3], survivors, fault_t=2.5) is None


def test_a_start_is_judged_from_every_groups_log_and_summarized() -> None:
    steady = [(float(i) * 0.5, i) for i in range(1, 21)]
    logs = {0: log(steady), 1: log(steady[:6] + [(9.0, 18), (9.5, 19)]), 2: log(steady)}
    s = judge(Start("unbroken", "kill"), logs, fault_t=T0 + 3.1)
    assert s.step_s == pytest.approx(0.5) and s.survivor_stall_s == 0.0
    assert s.full_strength_s == pytest.approx(9.0 - 3.1, abs=1e-3)
    crashed = Start("torchft", "kill", crashed=True, errors=["group 0 exited with 1"])
    out = summarize([s, crashed])
    assert out["starts"] == 2 and out["crashes"] == 1 and out["replicas_identical"] == 0
    assert out["full_strength_s"] == pytest.approx(9.0 - 3.1, abs=1e-3)


def test_a_hot_spare_in_the_victims_place_counts_for_full_strength() -> None:
    steady = [(float(i) * 0.5, i) for i in range(1, 21)]
    spare = [(4.0, 8), (4.5, 9)]  # parked until the fault, then in line at once
    restarted = [(12.0, 1)]  # the victim's restart: parked as a spare in its turn
    logs = {0: log(steady), 1: log(steady[:6] + restarted), 2: log(steady), 3: log(spare)}
    s = judge(Start("unbroken", "kill"), logs, fault_t=T0 + 3.1)
    assert s.full_strength_s == pytest.approx(4.0 - 3.1, abs=1e-3)


def test_a_restart_is_cut_into_imports_initialization_and_its_first_step() -> None:
    def at(t: float, text: str) -> str:
        stamp = datetime.datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        return f"[titan] {stamp} - root - INFO - {text}\n"

    parked = log([(1.0, 1), (2.0, 2)]) + at(6.0, "torchtitan version: 0.3.0") + at(7.5, "Training starts at step 1")
    text = parked + line(9.0, 3)
    s = judge(Start("unbroken", "kill"), {0: log([(1.0, 1), (2.0, 2)]), 1: text}, fault_t=T0 + 2.5)
    assert s.restart_phases_s == pytest.approx({"imported": 3.5, "initialized": 5.0, "first_step": 6.5}, abs=1e-3)
    waiting = judge(Start("unbroken", "kill"), {1: parked}, fault_t=T0 + 2.5)  # a hot spare now
    assert set(waiting.restart_phases_s) == {"imported", "initialized"}
    assert summarize([s])["restart_phases_s"]["first_step"] == pytest.approx(6.5, abs=1e-3)
