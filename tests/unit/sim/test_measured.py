"""unbroken's figures: read from bench JSON when present, defaults otherwise, scaled honestly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.sim.measured import STATE_GIB_PER_GPU, Figure, at_size, read_figures, read_requorum, unbroken_policy


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


def test_requorum_time_is_read_off_the_coordinator_curve_and_never_grows_slower_than_linear(tmp_path: Path) -> None:
    fallback = read_requorum(tmp_path)
    assert "default" in fallback.source and at_size(fallback, 1000) == pytest.approx(0.2)
    assert at_size(fallback, 100_000) == pytest.approx(20.0)  # the target, grown linearly
    rows = [{"replica_groups": n, "disconnect_to_epoch_ms": ms} for n, ms in ((10, 5.0), (100, 20.0), (1000, 80.0))]
    rows.append({"replica_groups": 5000, "disconnect_to_epoch_ms": None})  # a size that did not finish
    (tmp_path / "coordinator.json").write_text(json.dumps({"sizes": rows}))
    curve = read_requorum(tmp_path)
    assert "measured" in curve.source and curve.curve == ((10, 0.005), (100, 0.02), (1000, 0.08))
    assert at_size(curve, 5) == pytest.approx(0.005)
    assert at_size(curve, 100) == pytest.approx(0.02)
    assert 0.02 < at_size(curve, 300) < 0.08
    assert at_size(curve, 10_000) == pytest.approx(0.8)  # measured slope 0.6: linear beyond the data
    assert at_size(Figure(1.5, "x"), 10**6) == 1.5
    policy = unbroken_policy(read_figures(tmp_path), step_s=10.0, gpus=10_000)
    assert policy.stall_s["coordinator re-quorum at 10,000 GPUs"] == pytest.approx(0.8)


def test_a_run_through_node_connections_is_read_by_its_rank_count(tmp_path: Path) -> None:
    rows = [
        {"nodes": n, "ranks": 8 * n, "replica_groups": n, "disconnect_to_epoch_ms": ms}
        for n, ms in ((125, 60.0), (1000, 400.0))
    ]
    (tmp_path / "coordinator.json").write_text(json.dumps({"ranks_per_node": 8, "sizes": rows}))
    curve = read_requorum(tmp_path)
    assert curve.curve == ((1000, 0.06), (8000, 0.4))
    assert at_size(curve, 8000) == pytest.approx(0.4)


def test_the_group_rebuild_is_read_from_the_rendezvous_bench_else_ten_seconds(tmp_path: Path) -> None:
    assert read_figures(tmp_path)["pg_rebuild_s"].value == 10.0
    policy = unbroken_policy(read_figures(tmp_path), step_s=10.0)
    assert policy.stall_s["pg_rebuild"] == 10.0
    (tmp_path / "rendezvous.json").write_text(json.dumps({"group": {"members": 12}, "rebuild_at_scale_s": 0.25}))
    figures = read_figures(tmp_path)
    assert figures["pg_rebuild_s"].value == 0.25 and "rendezvous.json" in figures["pg_rebuild_s"].source
    assert unbroken_policy(figures, step_s=10.0).stall_s["pg_rebuild"] == 0.25
