"""unbroken's figures: read from bench JSON when present, defaults otherwise, scaled honestly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.sim.measured import STATE_GIB_PER_GPU, read_figures, unbroken_policy


def test_missing_directory_falls_back_to_targets_and_says_so(tmp_path: Path) -> None:
    figures = read_figures(tmp_path / "nowhere")
    assert all(f.source.startswith("default") for f in figures.values())


def test_present_fields_are_used_and_named(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text(
        json.dumps(
            {"steady_step_s": 0.2, "overhead_ratio": 1.02, "crash": {"survivor_stall_s": 0.4, "rejoin_steps": 1}}
        )
    )
    (tmp_path / "checkpoint.json").write_text(
        json.dumps({"size_mb": 512, "systems": {"unbroken": {"stall_s": 0.02, "durable_s": 2.0}}})
    )
    (tmp_path / "diagnosis.json").write_text(
        json.dumps(
            {
                "scenarios": [
                    {"kind": "hang", "detect_s": 1.0},
                    {"kind": "slow", "detect_s": 3.0},
                    {"kind": "clean", "clean": True, "detect_s": None},
                ]
            }
        )
    )
    figures = read_figures(tmp_path)
    assert figures["crash_stall_s"].value == 0.4 and "measured" in figures["crash_stall_s"].source
    assert figures["hang_stall_s"].source.startswith("default")
    assert figures["diagnosis_s"].value == pytest.approx(2.0)
    policy = unbroken_policy(figures, step_s=10.0)
    # 0.02 s for 0.5 GiB on one machine -> 0.04 s per GiB of per-GPU state.
    assert policy.checkpoint_stall_s == pytest.approx(0.04 * STATE_GIB_PER_GPU)
    assert policy.steady_overhead == pytest.approx(1.02 * 1.01 - 1)
    assert policy.degraded_s["catch_up_steps"] == pytest.approx(10.0)


def test_broken_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text("{not json")
    with pytest.raises(ValueError, match="recovery.json is not valid JSON"):
        read_figures(tmp_path)


def test_wrong_types_fall_back_instead_of_crashing(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text(json.dumps({"crash": {"survivor_stall_s": "fast"}, "overhead_ratio": -3}))
    figures = read_figures(tmp_path)
    assert figures["crash_stall_s"].source.startswith("default")
    assert figures["overhead_ratio"].source.startswith("default")


def test_reads_every_recovery_field_in_the_shape_bench_recovery_prints(tmp_path: Path) -> None:
    # The keys issue 2 specifies for `unbroken bench recovery --json`: crash and hang are objects.
    (tmp_path / "recovery.json").write_text(
        json.dumps(
            {
                "steady_step_s": 0.21,
                "baseline_step_s": 0.2,
                "overhead_ratio": 1.03,
                "crash": {"survivor_stall_s": 0.6, "rejoin_steps": 2, "donor_slowdown": 1.04},
                "hang": {"survivor_stall_s": 2.5},
                "replicas_identical": True,
            }
        )
    )
    figures = read_figures(tmp_path)
    expected = {
        "crash_stall_s": 0.6,
        "hang_stall_s": 2.5,
        "rejoin_steps": 2.0,
        "donor_slowdown": 1.04,
        "overhead_ratio": 1.03,
    }
    for name, value in expected.items():
        assert figures[name].value == pytest.approx(value), name
        assert figures[name].source.startswith("measured"), name
