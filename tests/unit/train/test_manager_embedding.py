"""The Manager's embedding contract that needs no job: the stack-dump signal, the vote's device,
state registration and the context manager (the integration tests run them in a real job)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from tests.unit.train.parts import manager_with_fakes
from unbroken.config import ConfigError, stack_signal
from unbroken.train.factory import build_manager, stack_dump_path
from unbroken.train.manager import Manager
from unbroken.train.step.vote import vote_device


def bare_manager() -> Manager:
    """A Manager whose parts are stand-ins (no coordinator, no process group)."""
    return manager_with_fakes()[0]


def test_stack_signal_is_configurable() -> None:
    import signal

    assert stack_signal({}) == signal.SIGUSR1
    assert stack_signal({"UNBROKEN_STACK_SIGNAL": "SIGUSR2"}) == signal.SIGUSR2
    assert stack_signal({"UNBROKEN_STACK_SIGNAL": "usr2"}) == signal.SIGUSR2
    assert stack_signal({"UNBROKEN_STACK_SIGNAL": str(int(signal.SIGRTMIN) + 1)}) == int(signal.SIGRTMIN) + 1
    assert stack_signal({"UNBROKEN_STACK_SIGNAL": "none"}) is None
    for bad in ("SIGKILL", "SIGTERM", "9", "bogus"):
        with pytest.raises(ConfigError, match="UNBROKEN_STACK_SIGNAL"):
            stack_signal({"UNBROKEN_STACK_SIGNAL": bad})


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[3]
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_stack_dump_chains_to_the_programs_own_handler(tmp_path: Path) -> None:
    result = run_python(f"""
        import os, signal, time
        from unbroken.diagnosis.stack_dump import install_stack_dump
        caught = []
        signal.signal(signal.SIGUSR1, lambda s, f: caught.append(s))  # Slurm's, Lightning's
        install_stack_dump({str(tmp_path / "stacks.txt")!r})
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not caught and time.monotonic() < deadline:
            time.sleep(0.01)
        print("caught", caught)
    """)
    assert result.returncode == 0, result.stderr
    assert f"caught [{int(__import__('signal').SIGUSR1)}]" in result.stdout
    assert "most recent call first" in (tmp_path / "stacks.txt").read_text()


def test_without_an_earlier_handler_the_dump_does_not_end_the_process(tmp_path: Path) -> None:
    result = run_python(f"""
        import os, signal, time
        from unbroken.diagnosis.stack_dump import install_stack_dump
        install_stack_dump({str(tmp_path / "stacks.txt")!r}, signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        print("alive")
    """)
    assert result.returncode == 0 and "alive" in result.stdout, result
    assert "most recent call first" in (tmp_path / "stacks.txt").read_text()


def test_the_vote_uses_a_tensor_the_backend_can_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert vote_device("gloo") == torch.device("cpu")
    assert vote_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert vote_device("nccl") == torch.device("cuda", 3)
    assert vote_device("cuda:nccl") == torch.device("cuda", 3)


def test_states_registered_after_construction_make_up_the_state() -> None:
    m = bare_manager()
    loaded: dict[str, Any] = {}
    m.register_state_dict_fn("model", lambda s: loaded.update(model=s), lambda: {"w": torch.ones(2)})
    m.register_state_dict_fn("data", lambda s: loaded.update(data=s), lambda: {"pos": 7})
    with pytest.raises(ValueError, match="already registered under 'data'"):
        m.register_state_dict_fn("data", lambda s: None, lambda: {})
    with pytest.raises(ValueError, match="non-empty string"):
        m.register_state_dict_fn("", lambda s: None, lambda: {})
    m.step = 5
    state = m.state_dict()
    assert sorted(state["user"]) == ["data", "model"] and state["unbroken"] == {"step": 5}
    m.step = 0
    m.load_state_dict(state)
    assert m.step == 5 and loaded["data"] == {"pos": 7} and torch.equal(loaded["model"]["w"], torch.ones(2))
    with pytest.raises(ValueError, match=r"missing: \['data'\]"):
        m.load_state_dict({"user": {"model": {}}, "unbroken": {"step": 1}})
    with pytest.raises(ValueError, match=r"unknown: \['rng'\]"):
        m.load_state_dict({"user": {"model": {}, "data": {}, "rng": 1}, "unbroken": {"step": 1}})


def test_the_old_pair_of_state_functions_is_a_thin_convenience() -> None:
    with pytest.raises(ValueError, match="both state_dict and load_state_dict"):
        build_manager(state_dict=lambda: {})  # refused before anything is built or connected
    with pytest.raises(ValueError, match="both state_dict and load_state_dict"):
        manager_with_fakes(load_state_dict=lambda s: None)
    loaded: list[Any] = []
    m = manager_with_fakes(state_dict=lambda: {"w": 1}, load_state_dict=loaded.append)[0]
    m.load_state_dict(m.state_dict())
    assert loaded == [{"w": 1}] and sorted(m.state_dict()["user"]) == ["state"]


def test_the_context_manager_leaves_finished_or_failed() -> None:
    m = bare_manager()
    with mock.patch.object(Manager, "shutdown") as shutdown:
        with m as entered:
            assert entered is m
        shutdown.assert_called_once_with(finished=True)
    with mock.patch.object(Manager, "shutdown") as shutdown:
        with pytest.raises(RuntimeError, match="boom"):
            with m:
                raise RuntimeError("boom")
        shutdown.assert_called_once_with(finished=False)


def test_the_stack_dump_never_lands_in_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from unbroken.config import ReplicaConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNBROKEN_RUN_DIR", raising=False)
    config = ReplicaConfig(coordinator="127.0.0.1:1", replica_id=2, num_replicas=3)
    path, tmp = stack_dump_path(config)
    assert tmp is not None and Path(path).parent == Path(tmp) and not Path(tmp).is_relative_to(tmp_path)
    Path(tmp).rmdir()
    config = ReplicaConfig(coordinator="127.0.0.1:1", replica_id=2, num_replicas=3, run_dir=str(tmp_path / "run"))
    assert stack_dump_path(config) == (str(tmp_path / "run" / "stacks" / "r2-rank0.txt"), None)


def test_background_work_hands_back_its_result_or_its_error_in_a_future() -> None:
    """The Manager's fetch and catch-up exchange: a daemon thread (never joined at exit) named
    for the docs' thread table, whose outcome the training thread gets from a Future."""
    import threading

    from unbroken.train.step.catch_up import in_background

    names: list[str] = []

    def work() -> int:
        names.append(threading.current_thread().name)
        assert threading.current_thread().daemon
        return 7

    assert in_background("unbroken-fetch", work).result(timeout=10) == 7 and names == ["unbroken-fetch"]

    def fail() -> int:
        raise ConnectionError("the donor went away")

    with pytest.raises(ConnectionError, match="the donor went away"):
        in_background("unbroken-fetch", fail).result(timeout=10)
