"""NaN is no number of seconds: every check of a duration refuses it, with the name of the field.

A check written ``if x <= 0: raise`` lets NaN through (every comparison with NaN is false), and a
NaN timeout then never fires or fires at once, depending on how each use compares it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.comm.deadline import LearnedDeadline
from unbroken.config import ConfigError, check_seconds
from unbroken.control.coordinator import CoordinatorSettings
from unbroken.launch.node.agent import AgentSettings
from unbroken.launch.run.launcher import LaunchSettings

NAN, INF = float("nan"), float("inf")


def test_check_seconds_names_every_bad_value() -> None:
    check_seconds({"a": 0.5, "b": 3})
    check_seconds({"a": 0.0}, zero_ok=True)
    for bad in (NAN, INF, -1.0, 0.0, "1"):
        with pytest.raises(ConfigError, match=r"a=") as e:
            check_seconds({"a": bad, "fine": 1.0})  # type: ignore[dict-item]
        assert "fine" not in str(e.value)
    with pytest.raises(ConfigError, match=">= 0: a=nan"):
        check_seconds({"a": NAN}, zero_ok=True)


@pytest.mark.parametrize(
    "field", ["heartbeat_timeout_s", "suspect_after_s", "join_window_floor_s", "startup_window_s", "finish_grace_s"]
)
def test_the_coordinators_durations_refuse_nan(field: str) -> None:
    CoordinatorSettings(total_replicas=2)  # the defaults pass
    with pytest.raises(ConfigError, match=f"{field}=nan"):
        CoordinatorSettings(total_replicas=2, **{field: NAN})


@pytest.mark.parametrize("field", ["connect_timeout_s", "heartbeat_s", "finish_grace_s"])
def test_the_agents_durations_refuse_nan(tmp_path: Path, field: str) -> None:
    kw = {"command": ("python", "train.py"), "coordinator": "127.0.0.1:1", "secret_file": tmp_path / "s"}
    AgentSettings(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nan"):
        AgentSettings(**kw, **{field: NAN})  # type: ignore[arg-type]


def test_the_launchers_heartbeat_timeout_and_the_learned_deadline_refuse_nan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--heartbeat-timeout=nan"):
        LaunchSettings(command=("python", "train.py"), replicas=2, run_dir=tmp_path, heartbeat_timeout_s=NAN)
    for kw in ({"floor_s": NAN}, {"factor": NAN}, {"initial_s": NAN}):
        with pytest.raises(ValueError):
            LearnedDeadline(**kw)
