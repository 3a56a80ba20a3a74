"""Precision and recall of diagnosis over many runs: the pure half of ``bench diagnosis --runs N``.

One run of a scenario cannot show a rate: a rule that is wrong one time in ten looks perfect
in it. ``--runs N`` repeats each fault kind and the clean run N times, each run a
:func:`variant` (another seed, with or without a CPU hog on the same cores, another step
time, the ring or the backend's exchange), and :func:`summarize` turns the scored runs into
one line per class: how often the fault was detected, named right (culprit and class), named
wrong, how many false verdicts came (before a fault began, or anywhere in a clean run) and per
hour of clean training, and how long a right verdict took after the fault began (median and
p90, in seconds and in steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unbroken.config import ENV_EXCHANGE
from unbroken.diagnosis.robust import quantile_of
from unbroken.diagnosis.rules.calibrate import calibration, held

if TYPE_CHECKING:
    from unbroken.bench.network.diagnosis import Scenario

Row = dict[str, Any]
CLEAN_CLASS = "clean"
PACES_S = (0.0, 0.05)  # a clean run's step time: as fast as it goes, or a larger model's pace
# Faults whose effect is extra compute: a paced step would absorb it in its sleep (and the
# fault would be invisible by design, not missed), so these always run unpaced.
COMPUTE_KINDS = frozenset({"slow_rank"})


def variant(sc: Scenario, i: int) -> Scenario:
    """Run ``i`` of ``sc``: seed ``i``, and a cycle over load, step time and exchange.

    Clean runs cover every combination in 8 runs: the ring on even ``i`` (the backend's
    exchange on odd), a CPU hog on the same cores in every other pair, a 50 ms pace in every
    other four. Fault runs get a hog one run in three and, where the fault is not extra compute,
    a pace every other run; chaos faults alternate ring and backend; link faults need the ring.
    """
    env = dict(sc.env)
    if sc.clean:
        if i % 2 == 0:
            env[ENV_EXCHANGE] = "ring"
        else:
            env.pop(ENV_EXCHANGE, None)
        return dataclasses.replace(
            sc, env=tuple(sorted(env.items())), hog=(i // 2) % 2 == 1, pace_s=PACES_S[(i // 4) % 2], seed=i
        )
    if sc.onset_step is None and i % 2 == 1:  # a chaos fault: any exchange
        env[ENV_EXCHANGE] = "ring"
    pace = 0.0 if sc.kind in COMPUTE_KINDS else PACES_S[i % 2] / 2
    return dataclasses.replace(sc, env=tuple(sorted(env.items())), hog=i % 3 == 2, pace_s=pace, seed=i)


def _q(xs: Sequence[float], q: float) -> float | None:
    return round(quantile_of(xs, q), 3) if xs else None


def summarize(rows: Sequence[Row]) -> Row:
    """Per-class rates from scored runs (``score``'s rows, each with its ``class``).

    A fault run counts ``named_right`` when its first verdict after onset names the culprit and
    an accepted class; ``wrong_culprit`` when that verdict names someone else; ``wrong_class``
    when it names the culprit under another class. Every verdict before onset, and every one in
    a clean run, is a false verdict. Precision is right verdicts over all first verdicts and
    false ones; recall is runs named right over fault runs.
    """
    classes: dict[str, list[Row]] = {}
    for r in rows:
        classes.setdefault(r["class"], []).append(r)
    out = []
    for name, rs in classes.items():
        faulty = [r for r in rs if not r["clean"]]
        right = [r for r in faulty if r["detected"] and r["culprit_correct"] and r["class_correct"]]
        detect = [r["detect_s"] for r in right if r.get("detect_s") is not None]
        steps = [float(r["detect_steps"]) for r in right if r.get("detect_steps") is not None]
        false = sum(r["false_positives"] for r in rs)
        clean_s = sum(r.get("span_s") or 0.0 for r in rs if r["clean"])
        line: Row = {
            "class": name,
            "runs": len(rs),
            "detected": sum(bool(r["detected"]) for r in faulty),
            "named_right": len(right),
            "wrong_culprit": sum(bool(r["detected"] and not r["culprit_correct"]) for r in faulty),
            "wrong_class": sum(bool(r["detected"] and r["culprit_correct"] and not r["class_correct"]) for r in faulty),
            "false_verdicts": false,
            "clean_hours": round(clean_s / 3600.0, 4),
            "false_verdicts_per_clean_hour": round(false / (clean_s / 3600.0), 2) if clean_s > 0 else None,
            "verdict_s_p50": _q(detect, 0.5),
            "verdict_s_p90": _q(detect, 0.9),
            "verdict_steps_p50": _q(steps, 0.5),
            "verdict_steps_p90": _q(steps, 0.9),
        }
        out.append(line)
    fault_runs = sum(c["runs"] for c in out if c["class"] != CLEAN_CLASS)
    right = sum(c["named_right"] for c in out)
    issued = right + sum(c["wrong_culprit"] + c["wrong_class"] + c["false_verdicts"] for c in out)
    return {
        "classes": out,
        "precision": round(right / issued, 4) if issued else None,
        "recall": round(right / fault_runs, 4) if fault_runs else None,
        "false_verdicts": sum(c["false_verdicts"] for c in out),
    }


# -- thresholds from measured distributions -------------------------------------------------

# rule -> (the fault scenarios it exists for, whether its score falls with the fault)
RULES: dict[str, tuple[frozenset[str], bool]] = {
    "step_time": (frozenset({"throughput_drop"}), False),
    "straggler": (frozenset({"straggler_1.5x", "straggler_3x"}), True),
    "link": (frozenset({"slow_link", "slow_node"}), False),
    # A direction judged alone (its link's other direction unknown), keyed "src-dst".
    "link_one_way": (frozenset({"slow_link", "slow_node"}), False),
}


def _culprit_keys(rule: str, culprit: int | tuple[int, int] | None, keys: Sequence[str]) -> list[str]:
    if culprit is None:
        return []
    if rule in ("link", "link_one_way"):
        if isinstance(culprit, tuple):
            return [k for k in keys if set(k.split("-")) == {str(c) for c in culprit}]
        return [k for k in keys if str(culprit) in k.split("-")]
    return [k for k in keys if k.split("/")[0] == str(culprit)]


def run_scores(
    name: str,
    clean: bool,
    culprit: int | tuple[int, int] | None,
    log: Sequence[dict[str, dict[str, float]]],
    confirm: dict[str, int],
) -> Row:
    """One run's held scores per rule (see :mod:`unbroken.diagnosis.rules.calibrate`), from the master's
    scores at each new collective (``log``): in a clean run every replica's or link's held
    scores are healthy; in a run of the rule's fault the culprit's best held score is the fault's
    (a node's: at each collective the weakest of its links). Scores are oriented higher = faultier."""
    out: Row = {}
    for rule, (faults, falls) in RULES.items():
        keys = sorted({k for entry in log for k in entry.get(rule, {})})
        series: dict[str, list[float]] = {}
        for entry in log:
            for k, x in entry.get(rule, {}).items():
                series.setdefault(k, []).append(_orient(x, falls))
        if clean:
            out[rule] = {"healthy": [round(h, 4) for xs in series.values() for h in held(xs, confirm[rule])]}
        elif name in faults:
            mine = _culprit_keys(rule, culprit, keys)
            by_step = [
                min(v)
                for entry in log
                if (v := [_orient(entry[rule][k], falls) for k in mine if k in entry.get(rule, {})])
            ]
            hs = held(by_step, confirm[rule]) if len(by_step) >= confirm[rule] else []
            out[rule] = {"faulty": [round(max(hs), 4)] if hs else []}
    return out


def _orient(x: float, falls: bool) -> float:
    return 1.0 / x if falls and x > 0 else x


def calibrate(rows: Sequence[Row], configured: dict[str, float]) -> Row:
    """Per rule: the healthy and fault distributions over all runs, the threshold they give,
    and the one in use (``configured``, oriented like the scores)."""
    out: Row = {}
    for rule in RULES:
        healthy = [x for r in rows for x in r.get("scores", {}).get(rule, {}).get("healthy", [])]
        faulty = [x for r in rows for x in r.get("scores", {}).get(rule, {}).get("faulty", [])]
        out[rule] = calibration(healthy, faulty, configured[rule])
    return out
