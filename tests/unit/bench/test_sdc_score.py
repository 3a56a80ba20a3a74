"""Scoring ``unbroken bench sdc``: which flips were caught and named, and which findings are false."""

from __future__ import annotations

from unbroken.bench.training.sdc import committed_differing, fault_plan, findings, overhead, score
from unbroken.faults.schedule import parse_flag


def ev(step: int, what: str, culprits: list[int], replica: int = 0) -> dict[str, object]:
    return {"kind": "sdc_detected", "step": step, "what": what, "culprits": culprits, "replica": replica}


def test_flips_are_matched_to_findings_and_the_rest_are_false() -> None:
    faults = [
        parse_flag("bitflip:replica=1,step=8,where=result"),
        parse_flag("bitflip:replica=0,step=20,where=weight"),
        parse_flag("bitflip:replica=2,step=30,where=result"),
        parse_flag("bitflip:replica=2,step=40,where=grad"),
    ]
    events = [
        ev(8, "results", [1], replica=0),
        ev(8, "results", [1], replica=2),  # the same finding from another member
        ev(25, "weights", [0]),
        ev(30, "results", []),  # two replicas: not known yet...
        ev(30, "rerun", [1]),  # ...and the re-run named the wrong one
        ev(33, "results", [2]),  # no flip there: false
        {"kind": "quorum", "step": 8},
    ]
    got = score(faults, events, [], weight_every=5)
    assert (got["injected"], got["detected"], got["culprit_named"]) == (3, 3, 2)
    assert got["false_detections"] == 1
    assert got["grad_flips"] == {"injected": 1, "detected": 0}
    assert [f["detect_steps"] for f in got["flips"]] == [0, 5, 0, None]


def test_a_weight_finding_past_two_checks_is_not_this_flip() -> None:
    got = score([parse_flag("bitflip:replica=0,step=20,where=moment")], [ev(31, "weights", [0])], [], 5)
    assert got["detected"] == 0 and got["false_detections"] == 1


def test_committed_differing_and_findings() -> None:
    rows = [
        {"step": 1, "committed": True, "exchange_fp": 5},
        {"step": 1, "committed": True, "exchange_fp": 5},
        {"step": 2, "committed": True, "exchange_fp": 5},
        {"step": 2, "committed": True, "exchange_fp": 6},
        {"step": 2, "committed": False, "exchange_fp": 7},
        {"step": 3, "committed": True, "exchange_fp": 0},  # not verified
    ]
    assert committed_differing(rows) == [2]
    assert findings([ev(1, "results", [0]), ev(1, "results", [2])]) == {(1, "results"): {0, 2}}


def test_overhead_is_the_checks_time_over_the_step_time() -> None:
    rows = [{"replica": 0, "committed": True, "check_s": 0.01 * i, "step_s": 1.0} for i in range(30)]
    assert abs((overhead(rows, skip=10) or 0) - 0.01) < 1e-9
    assert overhead(rows[:5], skip=10) is None


def test_the_plan_spreads_one_flip_of_each_kind() -> None:
    flags, steps = fault_plan(5)
    plan = [parse_flag(f) for f in flags]
    assert {f.where for f in plan} == {"grad", "result", "weight", "moment"}
    at = [f.step or 0 for f in plan]
    assert all(b - a >= 2 * 5 + 2 for a, b in zip(at, at[1:], strict=False)) and steps > at[-1] + 5


def test_the_alternating_llama_job_compares_each_on_block_with_the_off_block_before() -> None:
    from unbroken.bench.training.alternate import alternating_ratio

    rows: list[dict] = []
    for replica in range(3):
        spent = 0.0
        for step in range(90):
            on = (step // 10) % 2 == 1
            drift = 1.0 + step / 200  # the machine slows down through the job: blocks cancel it
            step_s = drift * (1.02 if on else 1.0)
            if step % 10 == 0:
                step_s = 9.0  # the step that switches is left out
            spent += 0.005 if on else 0.0
            rows.append(
                {"replica": replica, "step": step, "committed": True, "checked": on, "step_s": step_s, "check_s": spent}
            )
    out = alternating_ratio(rows, 10)
    assert out["pairs"] == 9  # blocks 3, 5, 7 in each of 3 replicas (block 1 is warm-up)
    assert 1.018 < out["ratio"] < 1.022  # the drift cancels between the off-blocks on either side
    assert out["own_share"] is not None and 0.003 < out["own_share"] < 0.006
    assert alternating_ratio([], 10) == {"ratio": None, "pairs": 0, "ratios_p10_p90": [], "own_share": None}
    recorded = [{k: v for k, v in r.items() if k != "check_s"} | {"recorded": r["checked"]} for r in rows]
    out = alternating_ratio(recorded, 10, flag="recorded", spent=None)  # another switch, no own time
    assert 1.018 < out["ratio"] < 1.022 and out["own_share"] is None
