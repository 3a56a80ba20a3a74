"""The recovery benchmark's figures, computed from synthetic step records.

The records mimic what :mod:`unbroken.bench.training.recovery_worker` writes, so the definitions of
stall, rejoin steps and donor slowdown are pinned without running processes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from unbroken.bench.training.recovery import (
    digests_identical,
    fault_figures,
    median_step,
    pair_order,
    paired_ratio,
    serving_figures,
)


def _steps(replica: int, steps: range, t_start: float, step_s: float, **extra: object) -> list[dict]:
    rows, t = [], t_start
    for s in steps:
        rows.append(
            {
                "step": s,
                "t0": t,
                "t1": t + step_s,
                "step_s": step_s,
                "committed": True,
                "behind": [],
                "donor": False,
                **extra,
            }
        )
        t += step_s
    return rows


def test_crash_figures_from_a_clean_rejoin() -> None:
    # Survivors 0 and 1 step every 0.1 s; the victim dies at t=2.05 (step 20 in flight),
    # the survivors' step 20 takes 0.4 s, the new process is ready at t=5.25 (step 49 in flight),
    # is behind in step 50 (replica 0 donates) and contributes from step 51.
    rows = {}
    for r in (0, 1):
        before = _steps(r, range(20), 0.0, 0.1)
        if r == 0:
            before[10]["step_s"] = 0.15  # one noisy step before the fault (its t1 stays put)
        stalled = [{"step": 20, "t0": 2.0, "t1": 2.4, "step_s": 0.4, "committed": True, "behind": [], "donor": False}]
        after = _steps(r, range(21, 60), 2.4, 0.1)
        for row in after:
            if row["step"] == 50:
                row["donor"] = r == 0
                row["step_s"] = 0.105
                row["snapshot_s"] = 0.004 if r == 0 else 0.0
                row["snapshot_early"] = r == 0
            if row["step"] == 51:  # the fetch outlasted step 50: the survivors wait for it in 51
                row["step_s"] = 0.13
        rows[r] = before + stalled + after
    victim = [{"event": "ready", "t": 0.0}] + _steps(2, range(20), 0.0, 0.1)
    victim += [{"event": "ready", "t": 5.25}]
    victim += [
        {
            "step": 50,
            "t0": 5.3,
            "t1": 5.4,
            "step_s": 0.1,
            "committed": True,
            "behind": [2],
            "donor": False,
            "fetch_s": 0.12,
        }
    ]
    victim += _steps(2, range(51, 60), 5.4, 0.1)
    rows[2] = victim

    f = fault_figures(rows, victim=2, fault_t=2.05)

    assert f.median_step_s == pytest.approx(0.1)
    assert f.survivor_stall_s == pytest.approx(0.3)
    assert f.catch_up_step == 50
    assert f.rejoin_steps == 2  # step 49 (in flight when ready) and the zero-gradient step 50
    assert f.donor_slowdown == pytest.approx(1.05)
    assert f.non_donor_slowdown == pytest.approx(1.05)  # replica 1 served nothing, paid the same
    assert f.donor_snapshot_s == pytest.approx(0.004)
    assert f.donor_snapshot_early is True and f.fetch_s == pytest.approx(0.12)
    assert f.catch_up_excess_s == pytest.approx(0.005 + 0.03)  # steps 50 and 51 above the median; 52 not
    # the rejoin: from the restart's ready (5.25 s) through step 52; the stalled steps came before
    assert f.worst_rejoin_step_s == pytest.approx(0.13) and f.worst_rejoin_ratio == pytest.approx(1.3)
    # Windows of the rejoin's 4 steps (49 to 52) before the fault, steps 5 to 19: 12 of them,
    # the 4 that hold the noisy step 10 read 1.5.
    assert f.clean_window_ratio_p50 == pytest.approx(1.0) and f.clean_window_ratio_p90 == pytest.approx(1.5)


def test_no_rejoin_is_reported_as_missing_not_zero() -> None:
    rows = {
        0: _steps(0, range(30), 0.0, 0.1),
        1: _steps(1, range(30), 0.0, 0.1),
        2: [{"event": "ready", "t": 0.0}] + _steps(2, range(15), 0.0, 0.1),
    }
    f = fault_figures(rows, victim=2, fault_t=1.55)
    assert f.rejoin_steps is None and f.donor_slowdown is None and f.catch_up_step is None
    assert f.survivor_stall_s == pytest.approx(0.0)


def test_median_needs_steady_steps() -> None:
    with pytest.raises(ValueError, match="--steps"):
        median_step({0: _steps(0, range(3), 0.0, 0.1)})


def test_median_of_another_field_skips_rows_without_it() -> None:
    rows = _steps(0, range(30), 0.0, 0.1)
    for i, r in enumerate(rows):
        if i % 2 == 0:
            r["cpu_s"] = 0.01 * i
    assert median_step({0: rows}, key="cpu_s") == pytest.approx(statistics.median(0.01 * i for i in range(6, 30, 2)))
    with pytest.raises(ValueError, match="cpu_s"):
        median_step({0: _steps(0, range(30), 0.0, 0.1)}, key="cpu_s")


def test_the_overhead_is_the_median_of_each_rounds_ratio() -> None:
    # The machine ran twice as fast in the second round: each round's ratio is 1.1.
    assert paired_ratio([1.0, 0.5, 1.0], [1.1, 0.55, 1.1]) == pytest.approx(1.1)
    assert paired_ratio([1.0, 1.0, 1.0], [1.0, 1.2, 1.05]) == pytest.approx(1.05)
    with pytest.raises(ValueError, match="paired"):
        paired_ratio([1.0], [1.0, 1.0])


def test_rounds_alternate_which_job_runs_first() -> None:
    orders = [pair_order(i) for i in range(4)]
    assert orders == [("baseline", "steady"), ("steady", "baseline")] * 2
    # Over an even number of rounds each job runs first as often as second: a linear drift of the
    # machine's speed adds the same total to both.
    firsts = [o[0] for o in orders]
    assert firsts.count("baseline") == firsts.count("steady")


def test_digests_identical_requires_every_replica(tmp_path: Path) -> None:
    for r in range(3):
        (tmp_path / f"digest-r{r}.json").write_text(json.dumps({"step": 60, "digest": "abc"}))
    assert digests_identical(tmp_path, 3)
    (tmp_path / "digest-r2.json").write_text(json.dumps({"step": 60, "digest": "abd"}))
    assert not digests_identical(tmp_path, 3)
    (tmp_path / "digest-r2.json").unlink()
    assert not digests_identical(tmp_path, 3)


def test_serving_figures_sum_what_the_donors_served(tmp_path: Path) -> None:
    (tmp_path / "digest-r0.json").write_text(
        json.dumps({"step": 60, "digest": "a", "served": [{"step": 50, "bytes": 200_000_000, "s": 0.5, "cpu_s": 0.04}]})
    )
    (tmp_path / "digest-r1.json").write_text(json.dumps({"step": 60, "digest": "a", "served": []}))
    got = serving_figures(tmp_path, 3, median_step_s=0.4)
    assert got == {"serve_s": 0.5, "serve_cpu_s": 0.04, "serve_mb": 200.0, "serve_cpu_step_share": 0.1}
    phases = {"handshake_s": 0.05, "wait_s": 0.0, "send_s": 0.4}  # records that split their time
    (tmp_path / "digest-r2.json").write_text(
        json.dumps({"step": 60, "digest": "a", "served": [{"step": 51, "bytes": 1, "s": 0.5, "cpu_s": 0.0, **phases}]})
    )
    got = serving_figures(tmp_path, 3, median_step_s=0.4)
    assert "serve_send_s" not in got  # not every record splits it: no sum of part of them
    (tmp_path / "digest-r0.json").unlink()
    got = serving_figures(tmp_path, 3, median_step_s=0.4)
    assert (got["serve_handshake_s"], got["serve_wait_s"], got["serve_send_s"]) == (0.05, 0.0, 0.4)
    assert serving_figures(tmp_path / "missing", 3, 0.4) == {}


def test_hidden_share_is_the_busy_exchange_not_waited_for() -> None:
    from unbroken.bench.training.recovery import hidden_share

    # The backend exchanged for 0.04 s a step; 0.01 s of it was left when backward ended.
    rows = {
        0: _steps(0, range(10), 0.0, 0.1, busy_s=0.04, exchange_s=0.01),
        1: _steps(1, range(10), 0.0, 0.1, busy_s=0.04, exchange_s=0.03),
    }
    got = hidden_share(rows)
    assert got["exchange_hidden_share"] == pytest.approx(0.5)
    assert got["exchange_busy_s"] == pytest.approx(0.04) and got["exchange_exposed_s"] == pytest.approx(0.02)
    assert hidden_share({0: _steps(0, range(10), 0.0, 0.1)}) == {}  # not a DDP run
