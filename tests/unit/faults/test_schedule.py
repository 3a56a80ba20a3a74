"""Fault schedules: parsing, and validation errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.faults.schedule import Schedule, ScheduleError, parse_flag


def test_flags_parse_into_typed_faults() -> None:
    s = Schedule.build(
        flags=[
            "crash:replica=1,step=40",
            "hang:replica=2,step=80,duration_s=5",
            "slow_rank:replica=0,factor=3,at_s=10s",
            "slow_link:link=0-2,mb_s=20,step=10",
            "nan_loss:replica=1,step=50,poison_grads=true",
            "coordinator_kill:at_s=30",
            "disk_full:replica=0,step=20,limit_mb=1",
        ]
    )
    crash, hang, slow, link, nan, coord, disk = s.faults
    assert (crash.kind, crash.replica, crash.rank, crash.step) == ("crash", 1, 0, 40)
    assert hang.duration_s == 5.0
    assert slow.factor == 3.0 and slow.at_s == 10.0 and slow.step is None
    assert link.link == (0, 2) and link.mb_s == 20.0 and link.replicas == (0, 2)
    assert nan.poison_grads is True
    assert coord.target == "coordinator"
    assert disk.limit_mb == 1.0
    assert [f.kind for f in s.supervisor_faults()] == ["crash", "hang", "coordinator_kill", "disk_full"]
    assert [f.kind for f in s.worker_faults(0, 0)] == ["slow_rank", "slow_link"]
    assert [f.kind for f in s.worker_faults(2, 0)] == ["slow_link"]


def test_file_and_flags_combine_and_round_trip(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "faults:\n  - {kind: crash, replica: 1, step: 40}\n  - kind: hang\n    replica: 2\n    at_s: 3\n"
    )
    (tmp_path / "s.json").write_text(json.dumps([{"kind": "slow_rank", "replica": 0, "factor": 2, "step": 5}]))
    s = Schedule.build(files=[tmp_path / "s.yaml", tmp_path / "s.json"], flags=["nan_loss:replica=0,step=9"])
    assert [f.kind for f in s] == ["crash", "hang", "slow_rank", "nan_loss"]
    assert Schedule.from_data(s.to_json()) == s


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("explode:replica=1,step=3", "unknown fault kind 'explode'"),
        ("crash:step=3", "missing target, add replica=N"),
        ("crash:replica=1", "exactly one trigger"),
        ("crash:replica=1,step=3,at_s=2", "exactly one trigger"),
        ("crash:replica=1,step=-3", "step must be an integer >= 0"),
        ("crash:replica=1,step=two", "step='two' is not valid"),
        ("crash:replica=1,step=3,factor=2", "crash does not take factor"),
        ("crash:replica=1,step", "should be key=value"),
        ("slow_rank:replica=1,step=3", "factor > 1"),
        ("slow_rank:replica=1,step=3,factor=0.5", "factor > 1"),
        ("slow_link:link=1-1,mb_s=3,step=3", "two different replicas"),
        ("slow_link:link=0-1,step=3", "needs mb_s > 0"),
        ("slow_link:link=zero,mb_s=3,step=3", "two replica ids"),
        ("hang:replica=0,step=3,duration_s=0", "duration_s must be > 0"),
        ("coordinator_kill:replica=0,at_s=3", "does not take replica"),
    ],
)
def test_bad_flags_say_what_to_fix(flag: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_flag(flag)


def test_targets_are_checked_against_the_job() -> None:
    with pytest.raises(ScheduleError, match=r"replica 3 is out of range, the job has replicas 0..2"):
        Schedule.build(flags=["crash:replica=3,step=1"]).validate(replicas=3)
    with pytest.raises(ScheduleError, match=r"rank 1 is out of range"):
        Schedule.build(flags=["crash:replica=0,rank=1,step=1"]).validate(replicas=3, ranks_per_replica=1)
    with pytest.raises(ScheduleError, match=r"replica 5 is out of range"):
        Schedule.build(flags=["slow_link:link=0-5,mb_s=1,step=1"]).validate(replicas=3)
    with pytest.raises(ScheduleError, match="coordinator_kill needs"):
        Schedule.build(flags=["coordinator_kill:at_s=1"]).validate(replicas=3, coordinator_in_process=False)


def test_bad_files_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="cannot read the fault schedule"):
        Schedule.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("faults: [kind: crash\n")
    with pytest.raises(ScheduleError, match="not valid YAML"):
        Schedule.load(tmp_path / "bad.yaml")
    (tmp_path / "top.yaml").write_text("fault: []\n")
    with pytest.raises(ScheduleError, match="unknown top-level keys fault"):
        Schedule.load(tmp_path / "top.yaml")
    (tmp_path / "nokind.yaml").write_text("- {replica: 1, step: 3}\n")
    with pytest.raises(ScheduleError, match=r"fault #1: missing kind"):
        Schedule.load(tmp_path / "nokind.yaml")


def test_triggers() -> None:
    by_step, by_time = parse_flag("crash:replica=0,step=10"), parse_flag("crash:replica=0,at_s=5")
    assert not by_step.due(9, 100.0) and by_step.due(10, 0.0)
    assert not by_time.due(100, 4.9) and by_time.due(0, 5.0)
