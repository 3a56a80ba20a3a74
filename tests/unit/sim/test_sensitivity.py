"""The projection's sensitivity: which input moves ETTR most, and the bound a target puts on one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from unbroken.sim.evaluation import evaluate
from unbroken.sim.presets import load_preset
from unbroken.sim.sensitivity import largest_meeting, replica_restart_for, swings


def bench_dir(tmp_path: Path, overhead: float = 1.01) -> Path:
    (tmp_path / "recovery.json").write_text(
        json.dumps(
            {
                "overhead_ratio": overhead,
                "crash": {"survivor_stall_s": 0.5, "rejoin_steps": 2, "donor_slowdown": 1.1},
                "hang": {"survivor_stall_s": 3.0},
            }
        )
    )
    (tmp_path / "diagnosis.json").write_text(
        json.dumps({"record_overhead_ratio": 1.0, "scenarios": [{"detect_s": 2.0}]})
    )
    rows = [{"nodes": n, "ranks": 8 * n, "disconnect_to_epoch_ms": ms} for n, ms in ((1000, 300), (12500, 1000))]
    (tmp_path / "coordinator.json").write_text(json.dumps({"ranks_per_node": 8, "sizes": rows}))
    return tmp_path


def test_every_cost_lowers_ettr_when_doubled_and_ratios_vary_by_their_excess(tmp_path: Path) -> None:
    preset = load_preset("unbroken-measured", bench_dir(tmp_path))
    found = {w.name: w for w in swings(preset.cluster, preset.figures)}
    assert {"replica_restart_s", "pg_rebuild_s", "overhead_ratio", "crash_stall_s"} <= set(found)
    assert "checkpoint_size_mb" not in found  # a normaliser, not a cost
    for w in found.values():
        assert w.ettr_half >= w.ettr_double, w
    # a ratio's excess is halved (1.005), not the ratio (0.505, which would be a speed-up)
    assert 0.9 < found["overhead_ratio"].ettr_half < 1.0
    spreads = [w.spread for w in swings(preset.cluster, preset.figures)]
    assert spreads == sorted(spreads, reverse=True)


def test_the_replica_restart_bound_is_where_the_projection_meets_the_target(tmp_path: Path) -> None:
    preset = load_preset("unbroken-measured", bench_dir(tmp_path))
    bound = replica_restart_for(preset.cluster, preset.figures, 0.95)
    assert 0 < bound < 3600
    result = evaluate(preset, runs=2, intervals=False)
    assert result["sensitivity"]["max_replica_restart_s_for_target"] == pytest.approx(bound, abs=0.1)
    heavy = load_preset("unbroken-measured", bench_dir(tmp_path, overhead=1.2))  # 20% steady overhead
    assert math.isnan(replica_restart_for(heavy.cluster, heavy.figures, 0.95))  # no restart time saves it


def test_largest_meeting_bisects_a_falling_function() -> None:
    assert largest_meeting(lambda x: 1 - x / 100, 0.9, 0, 100) == pytest.approx(10, abs=1e-6)
    assert math.isnan(largest_meeting(lambda x: 0.5, 0.9, 0, 100))
    assert largest_meeting(lambda x: 1.0, 0.9, 0, 100) == 100
