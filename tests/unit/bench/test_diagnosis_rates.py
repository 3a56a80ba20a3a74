"""Rates over many runs: per-class precision and recall from scored runs, and the run variants."""

from __future__ import annotations

import pytest

from unbroken.bench.network.diagnosis import SCENARIOS, plan
from unbroken.bench.network.diagnosis_rates import CLEAN_CLASS, summarize, variant
from unbroken.config import ENV_EXCHANGE


def run(cls: str, right: bool = True, culprit: bool = True, detect_s: float | None = 2.0, fp: int = 0) -> dict:
    clean = cls == CLEAN_CLASS
    return {
        "class": cls,
        "clean": clean,
        "detected": None if clean else detect_s is not None,
        "culprit_correct": None if clean else culprit,
        "class_correct": None if clean else right,
        "detect_s": None if clean else detect_s,
        "detect_steps": None if clean or detect_s is None else int(detect_s * 10),
        "false_positives": fp,
        "span_s": 1800.0 if clean else 10.0,
    }


def by_class(result: dict) -> dict:
    return {c["class"]: c for c in result["classes"]}


def test_rates_per_class_name_wrong_culprits_and_false_verdicts() -> None:
    rows = [run("slow_link", detect_s=float(s)) for s in range(1, 10)]
    rows += [run("slow_link", culprit=False), run("slow_link", detect_s=None)]
    rows += [run(CLEAN_CLASS), run(CLEAN_CLASS, fp=2), run("nan_loss", right=False, fp=1)]
    got = summarize(rows)
    sl, clean, nan = (by_class(got)[k] for k in ("slow_link", CLEAN_CLASS, "nan_loss"))
    assert (sl["runs"], sl["detected"], sl["named_right"], sl["wrong_culprit"]) == (11, 10, 9, 1)
    assert sl["verdict_s_p50"] == pytest.approx(5.0) and sl["verdict_s_p90"] == pytest.approx(8.2)  # right ones
    assert (clean["runs"], clean["false_verdicts"], clean["clean_hours"]) == (2, 2, 1.0)
    assert clean["false_verdicts_per_clean_hour"] == 2.0
    assert (nan["wrong_class"], nan["false_verdicts"]) == (1, 1)
    # 9 right + 1 wrong culprit + 1 wrong class + 3 false; 9 right of 12 fault runs
    assert got["precision"] == pytest.approx(9 / 14, abs=1e-4) and got["recall"] == pytest.approx(9 / 12, abs=1e-4)


def test_required_fields_are_there_even_without_verdicts() -> None:
    c = by_class(summarize([run(CLEAN_CLASS)]))[CLEAN_CLASS]
    assert {"class", "runs", "named_right", "wrong_culprit", "false_verdicts", "verdict_s_p50", "verdict_s_p90"} <= set(
        c
    )
    assert c["verdict_s_p50"] is None and c["false_verdicts"] == 0


def test_clean_variants_cover_ring_backend_hog_and_pace_in_eight_runs() -> None:
    clean = next(s for s in SCENARIOS if s.name == "clean")
    vs = [variant(clean, i) for i in range(8)]
    combos = {(dict(v.env).get(ENV_EXCHANGE, "backend"), v.hog, v.pace_s) for v in vs}
    assert len(combos) == 8 and len({v.seed for v in vs}) == 8


def test_link_faults_keep_the_ring_and_compute_faults_are_never_paced() -> None:
    link = next(s for s in SCENARIOS if s.name == "slow_link")
    slow = next(s for s in SCENARIOS if s.name == "straggler_3x")
    assert all(dict(variant(link, i).env)[ENV_EXCHANGE] == "ring" for i in range(6))
    assert all(variant(slow, i).pace_s == 0.0 for i in range(6))
    assert {dict(variant(slow, i).env).get(ENV_EXCHANGE, "backend") for i in range(2)} == {"ring", "backend"}
    assert any(variant(slow, i).hog for i in range(3))


def test_plan_runs_each_fault_kind_and_the_clean_run_n_times() -> None:
    jobs = plan((), 3)
    faults = [s for s in SCENARIOS if not s.clean]
    assert len(jobs) == 3 * (len(faults) + 1)
    assert sorted(i for s, i in jobs if s.name == "clean") == [0, 1, 2]
    assert [s.name for s, _ in plan(("slow_link",), 0)] == ["slow_link"]


def test_run_scores_split_healthy_from_the_culprits_fault() -> None:
    from unbroken.bench.network.diagnosis_rates import calibrate, run_scores

    confirm = {"step_time": 2, "straggler": 2, "link": 2, "link_one_way": 2}
    healthy_log = [
        {"step_time": {"0/0": 1.0, "1/0": 1.1}, "straggler": {"0/0": 1.0, "1/0": 0.8}, "link": {"0-1": 0.5}}
    ] * 3
    clean = run_scores("clean", True, None, healthy_log, confirm)
    assert sorted(clean["step_time"]["healthy"]) == [1.0, 1.0, 1.1, 1.1]
    assert max(clean["straggler"]["healthy"]) == 1.25  # 1 / 0.8: oriented higher = faultier
    fault_log = [{"straggler": {"0/0": 0.5, "1/0": 1.0}}, {"straggler": {"0/0": 0.6, "1/0": 1.0}}]
    fault = run_scores("straggler_1.5x", False, 0, fault_log, confirm)
    assert fault == {"straggler": {"faulty": [pytest.approx(1 / 0.6, abs=1e-3)]}}  # held: the weaker of the two
    node_log = [{"link": {"0-2": 9.0, "1-2": 7.0, "0-1": 0.5}}] * 2
    assert run_scores("slow_node", False, 2, node_log, confirm)["link"] == {"faulty": [7.0]}  # its weakest link
    lone_log = [{"link_one_way": {"2-0": 30.0, "2-1": 25.0, "0-1": 0.4}}] * 2  # "src-dst", judged alone
    assert run_scores("slow_node", False, 2, lone_log, confirm)["link_one_way"] == {"faulty": [25.0]}
    link_log = [{"link": {"0-2": 9.0, "1-2": 0.7, "0-1": 0.5}}] * 2
    assert run_scores("slow_link", False, (2, 0), link_log, confirm)["link"] == {"faulty": [9.0]}
    got = calibrate(
        [{"scores": clean}, {"scores": fault}], {"step_time": 1.2, "straggler": 1.39, "link": 2.5, "link_one_way": 5.0}
    )
    assert got["straggler"]["derived_threshold"] == pytest.approx((1.25 * (1 / 0.6)) ** 0.5, abs=1e-3)
    assert got["link"]["healthy"]["max"] == 0.5 and got["link"]["derived_threshold"] is None  # no fault measured
