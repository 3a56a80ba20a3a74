"""Runs a real job (launcher, coordinator, replica processes) and injects real faults."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.config import ENV_SECRET_FILE
from unbroken.observe.events import read_jsonl
from unbroken.wire.auth import JobSecret

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "gpt" / "train.py"
# Each example step lasts at least this long: a restarted replica (seconds to import torch on
# a busy 2-core machine) then still finds steps left to rejoin, whatever the machine's load.
PACE = ["--pace-s", "0.12"]


class Job:
    """``unbroken run`` of the example GPT in ``run_dir``; always cleaned up on exit."""

    def __init__(
        self,
        run_dir: Path,
        replicas: int = 3,
        steps: int = 60,
        extra: list[str] | None = None,
        train_args: list[str] | None = None,
        coordinator: str | None = None,
        script: Path = TRAIN,
        env: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.replicas = replicas
        cmd = [sys.executable, "-m", "unbroken", "run", "--replicas", str(replicas), "--run-dir", str(run_dir)]
        if coordinator:  # started apart (python_env() hands it the tests' job secret)
            cmd += ["--coordinator", coordinator, "--secret-file", str(job_secret_file())]
        cmd += (
            (extra or [])
            + ["--", sys.executable, str(script), "--steps", str(steps)]
            + (PACE if train_args is None else train_args)
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "events.jsonl") if kind is None or e["kind"] == kind]

    def metrics(self, replica: int) -> list[dict[str, Any]]:
        return metrics(self.run_dir, replica)

    def pid(self, replica: int) -> int:
        return [e["pid"] for e in self.events("process_started") if e["replica"] == replica][-1]

    def wait_for_step(self, replica: int, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [row["step"] for row in self.metrics(replica) if "step" in row]  # not the "ready" line
            if steps and steps[-1] >= step:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended early with code {self.proc.returncode}")
            time.sleep(0.05)
        raise AssertionError(f"replica {replica} did not reach step {step} in {timeout}s")

    def final_states(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.replicas):
            path = self.run_dir / f"final-r{r}.pt"
            if path.exists():
                out[r] = torch.load(path, weights_only=False)
        return out


def assert_identical(states: dict[int, dict[str, Any]]) -> None:
    """Every replica holds bitwise-identical parameters and optimizer state."""
    assert len(states) >= 2, f"only {len(states)} replicas wrote a final state"
    ref_id, ref = next(iter(states.items()))
    for r, s in states.items():
        assert s["step"] == ref["step"], (r, s["step"], ref["step"])
        for k, v in ref["model"].items():
            assert torch.equal(v, s["model"][k]), f"replica {r} parameter {k} differs from replica {ref_id}"
        for pid, st in ref["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, s["optim"]["state"][pid][k]), f"replica {r} optimizer {pid}.{k} differs"


_SECRET_FILE: Path | None = None


def job_secret_file() -> Path:
    """One job secret (a 0600 file in a private temporary directory) for the processes tests
    start by hand: coordinators, agents and bare workers find it in UNBROKEN_SECRET_FILE."""
    global _SECRET_FILE
    if _SECRET_FILE is None:
        tmp = tempfile.mkdtemp(prefix="unbroken-test-secret-")
        atexit.register(shutil.rmtree, tmp, True)
        _SECRET_FILE = JobSecret.generate().write(Path(tmp) / "secret")
    return _SECRET_FILE


def job_secret() -> JobSecret:
    return JobSecret.load(job_secret_file())


def python_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        ENV_SECRET_FILE: str(job_secret_file()),
    }


class Processes:
    """Processes a test starts by hand (a coordinator, bare workers); all ended on exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def start(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.run_dir / f"{name}.log", "ab") as log:
            p = subprocess.Popen(
                args, env=env or python_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(p)
        return p

    def coordinator(
        self, port: int, replicas: int, min_replicas: int, state_dir: Path, *extra: str
    ) -> subprocess.Popen[bytes]:
        return self.start(
            [
                sys.executable,
                "-m",
                "unbroken",
                "coordinator",
                "--replicas",
                str(replicas),
                "--min-replicas",
                str(min_replicas),
                "--port",
                str(port),
                "--state-dir",
                str(state_dir),
                "--startup-window",
                "3",
                *extra,
            ],
            "coordinator" + "".join(extra),
        )

    def worker(self, replica: int, coordinator: str, replicas: int, steps: int) -> subprocess.Popen[bytes]:
        env = {
            **python_env(),
            "UNBROKEN_COORDINATOR": coordinator,
            "UNBROKEN_REPLICA_ID": str(replica),
            "UNBROKEN_NUM_REPLICAS": str(replicas),
            "UNBROKEN_RUN_DIR": str(self.run_dir),
        }
        return self.start([sys.executable, str(TRAIN), "--steps", str(steps), *PACE], f"worker{replica}", env)


def metrics(run_dir: Path, replica: int) -> list[dict[str, Any]]:
    """The replica's metrics rows so far (a line still being written is skipped)."""
    return list(read_jsonl(run_dir / f"metrics-r{replica}.jsonl"))


def wait_for_step(run_dir: Path, replica: int, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = metrics(run_dir, replica)
        if rows and rows[-1]["step"] >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"replica {replica} did not reach step {step} in {timeout}s")


def load_finals(run_dir: Path, replicas: list[int]) -> dict[int, dict[str, Any]]:
    return {
        r: torch.load(run_dir / f"final-r{r}.pt", weights_only=False)
        for r in replicas
        if (run_dir / f"final-r{r}.pt").exists()
    }


def run_ranks(worker: Path, out: Path, world_size: int = 2, timeout: float = 100.0) -> tuple[list[int], str]:
    """Runs ``worker --out OUT`` as ``world_size`` torch.distributed ranks with torchrun's
    variables (no unbroken launcher); returns their exit codes and the tails of their logs."""
    from unbroken.launch.workers import free_port

    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world_size):
            env = {
                **python_env(),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker), "--out", str(out)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
    return codes, logs
