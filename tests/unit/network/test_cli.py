"""``unbroken plan`` and ``unbroken bench planner`` from a user's seat."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from unbroken.cli import main

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "network"


def _plan(tmp_path: Path, *extra: str):
    return CliRunner().invoke(
        main,
        [
            "plan",
            "--topology",
            str(EXAMPLES / "fabric.yaml"),
            "--jobs",
            str(EXAMPLES / "jobs.yaml"),
            "--out",
            str(tmp_path / "a.json"),
            "--adapter",
            str(tmp_path / "s.json"),
            *extra,
        ],
    )


def test_plan_prints_table_and_writes_assignment_and_settings(tmp_path: Path) -> None:
    result = _plan(tmp_path, "--fail", "leaf.p0.b0.r0:spine.p0.pod0.s1")
    assert result.exit_code == 0, result.output
    assert "llm-a" in result.output and "re-weight" in result.output
    assignment = json.loads((tmp_path / "a.json").read_text())
    assert {"job", "phase", "src", "dst", "bytes", "paths"} <= set(assignment["connections"][0])
    for conn in assignment["connections"]:
        for path in conn["paths"]:
            assert not {"leaf.p0.b0.r0", "spine.p0.pod0.s1"} <= set(path["nodes"][1:3])
    settings = json.loads((tmp_path / "s.json").read_text())
    assert set(settings["jobs"]) == {"llm-a", "llm-b"}
    assert "NCCL_IB_QPS_PER_CONNECTION" in settings["env"]


def test_bad_failure_is_a_usage_error(tmp_path: Path) -> None:
    result = _plan(tmp_path, "--fail", "no-such-switch")
    assert result.exit_code == 2
    assert "give a switch name" in result.output


def test_bench_planner_json_fields(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "planner", "--json", "--only", "gpu64-2job-2port", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == json.loads(out.read_text())
    names = [s["name"] for s in data["scenarios"]]
    assert names == ["gpu64-2job-2port", "gpu64-2job-2port-linkfail"]
    for s in data["scenarios"]:
        assert {
            "name",
            "gpus",
            "jobs",
            "failure",
            "ecmp_time_s",
            "planner_time_s",
            "ideal_time_s",
            "exact_time_s",
            "plan_s",
        } <= set(s)
        assert s["gpus"] == 64 and s["jobs"] == 2
        assert s["exact_time_s"] <= s["planner_time_s"] * (1 + 1e-6)
    assert data["scenarios"][1]["failure"] is True


def test_bench_unknown_scenario(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "planner", "--only", "nope", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "matches no scenario" in result.output
