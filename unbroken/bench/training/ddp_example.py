"""``unbroken bench torchft-ddp``: torchft's own ``train_ddp.py`` example on unbroken, through a fault.

torchft's example script (its repository's root, not in its wheel: ``make torchft-example`` puts
it at ``.cache/upstream/train_ddp.py``) runs unedited under ``unbroken run --torchft-compat
--replicas 2``, behind the stand-ins of :mod:`unbroken.bench.training.ddp_example_standins`
(torchvision and CIFAR-10 only). It is copied into a folder of its own first: run from
torchft's checkout, ``python train_ddp.py`` would import the checkout's ``torchft`` package,
which sits beside it. When replica 1 begins step ``--fault-step`` it is ``kill -9``-ed (or
``SIGSTOP``-ped, and ``SIGCONT``-ed ``--stop-s`` later); the launcher restarts it, it catches up
from replica 0 and trains on. The script never ends before its 10,000th step, so once both
replicas have committed ``--fault-step + --steps-after`` steps the harness ends the job with
SIGTERM, as a scheduler would.

Per start:

- ``crashed``: a process other than the faulted one exited with an error, or the job's exit
  after the SIGTERM was not clean;
- ``hung``: the replicas had not reached the last step after ``--timeout-s``;
- ``replicas_identical``: the SHA-256 of both replicas' model and optimizer state (through the
  script's own ``state_dict`` function) after the last step are equal, and so they are before
  the fault;
- ``sdc_detected``: the verified exchange's findings during the job (none expected);
- ``survivor_stall_s``, ``full_strength_s``, ``step_s``: as in ``unbroken bench torchtitan``,
  from the replicas' step lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.bench.training.titan_trainer import (
    FAULTS,
    full_strength_s,
    inject,
    resume,
    stall_s,
    steady_step_s,
    stop_all,
)
from unbroken.config import python_path
from unbroken.observe.events import read_jsonl

REPLICAS = 2
VICTIM = 1
OBSERVED = re.compile(r"^unbroken-observe step=(\d+) t=([0-9.]+)$", re.M)
# torchft's commit whose train_ddp.py `make torchft-example` fetches, and that file's SHA-256
SCRIPT_COMMIT = "73dafea422116b2a713542719c8454efe5444c6c"
SCRIPT_SHA256 = "cd4406ce2c5dbc8777e4700e32c6016eea317fa48183fc74567751b8636cf8cc"


def step_times(text: str) -> list[tuple[float, int]]:
    """``(wall time, committed steps)`` as each step of one replica's log began, in order."""
    return [(float(t), int(s)) for s, t in OBSERVED.findall(text)]


@dataclasses.dataclass
class Start:
    """One start of the example through one fault."""

    fault: str
    crashed: bool = False
    hung: bool = False
    replicas_identical: bool = False
    identical_before_fault: bool = False
    sdc_detected: int = 0
    restarts: int = 0
    survivor_stall_s: float | None = None
    full_strength_s: float | None = None
    step_s: float | None = None
    wall_s: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)


def judge(start: Start, logs: dict[int, str], fault_t: float | None) -> Start:
    """Fills ``start``'s timings from the replicas' step lines."""
    times = {r: step_times(text) for r, text in logs.items()}
    if fault_t is None:
        return start
    step = steady_step_s(times.get(0, []), fault_t, skip=1)
    if step is not None:
        start.step_s = round(step, 3)
        start.survivor_stall_s = round(stall_s(times.get(0, []), fault_t, step), 3)
    got = full_strength_s(times.get(VICTIM, []), [times.get(0, [])], fault_t)
    start.full_strength_s = None if got is None else round(got, 3)
    return start


def digests(run_dir: Path, step: int) -> dict[int, str]:
    """Each replica's state digest after ``step`` committed steps, where it wrote one."""
    out = {}
    for r in range(REPLICAS):
        path = run_dir / f"digest-r{r}-s{step}.json"
        if path.exists():
            out[r] = json.loads(path.read_text())["sha256"]
    return out


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _latest_step(log: Path) -> int:
    return max((s for _, s in step_times(_read(log))), default=-1)


def run_start(out: Path, script: Path, args: Any, env: dict[str, str]) -> Start:
    start = Start(args.fault)
    run_dir = out / "run"
    example = out / "example"
    example.mkdir(parents=True)
    shutil.copy(script, example / "train_ddp.py")
    standins = Path(__file__).with_name("ddp_example_standins.py")
    last = args.fault_step + args.steps_after
    cmd = [sys.executable, "-m", "unbroken", "run", "--torchft-compat", "--replicas", str(REPLICAS)]
    cmd += ["--min-replicas", "1", "--run-dir", str(run_dir), "--", sys.executable, str(standins)]
    cmd += ["--digest-steps", f"{args.fault_step - 1},{last}", str(example / "train_ddp.py")]
    logs = {r: run_dir / "logs" / f"replica{r}-rank0.log" for r in range(REPLICAS)}
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    with open(out / "run.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fault_t, victim = None, None

    def wait_for(step: int, replicas: range | list[int]) -> bool:
        while time.monotonic() < deadline and proc.poll() is None:
            if all(_latest_step(logs[r]) >= step for r in replicas):
                return True
            time.sleep(0.2)
        return False

    try:
        if wait_for(args.fault_step, [VICTIM]):
            started = read_jsonl(run_dir / "events.jsonl")
            victim = [e["pid"] for e in started if e["kind"] == "process_started" and e["replica"] == VICTIM][-1]
            fault_t = inject(args.fault, victim)
            if args.fault == "stop":
                while time.time() - fault_t < args.stop_s and proc.poll() is None:
                    time.sleep(0.1)
                resume(victim)
        # a step line is written as the step after it begins: `last` committed, digest written
        if fault_t is None or not wait_for(last + 1, range(REPLICAS)):
            start.hung = proc.poll() is None
            start.errors.append(f"the replicas did not reach step {last + 1} (rc {proc.poll()})")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                rc = None
                start.errors.append("unbroken run did not end within 120 s of SIGTERM")
            if rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM, None):
                start.crashed = True
                start.errors.append(f"unbroken run exited with {rc} after SIGTERM")
        elif proc.returncode != 0:
            start.crashed = True
            start.errors.append(f"unbroken run exited with {proc.returncode} before the end")
    finally:
        stop_all([proc])
    start.wall_s = round(time.monotonic() - t0, 3)
    events = list(read_jsonl(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    for e in events:
        if (
            e["kind"] == "process_exited"
            and e.get("exitcode") not in (0, None, -signal.SIGTERM)
            and e.get("pid") != victim
        ):
            start.crashed = True
            start.errors.append(f"replica {e['replica']} pid {e['pid']} exited with {e['exitcode']}")
    start.sdc_detected = sum(1 for e in events if e["kind"] == "sdc_detected")
    start.restarts = sum(1 for e in events if e["kind"] == "process_started" and e.get("restart", 0) > 0)
    before, after = digests(run_dir, args.fault_step - 1), digests(run_dir, last)
    start.identical_before_fault = len(before) == REPLICAS and len(set(before.values())) == 1
    start.replicas_identical = len(after) == REPLICAS and len(set(after.values())) == 1
    return judge(start, {r: _read(p) for r, p in logs.items()}, fault_t)


def summarize(starts: list[Start]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        vals = [v for s in starts if (v := getattr(s, key)) is not None]
        return round(statistics.median(vals), 3) if vals else None

    return {
        "starts": len(starts),
        "crashes": sum(s.crashed for s in starts),
        "hangs": sum(s.hung for s in starts),
        "replicas_identical": sum(s.replicas_identical for s in starts),
        "sdc_detected": sum(s.sdc_detected for s in starts),
        "survivor_stall_s": median("survivor_stall_s"),
        "full_strength_s": median("full_strength_s"),
        "step_s": median("step_s"),
        "per_start": [dataclasses.asdict(s) for s in starts],
    }


def example_script(root: Path, given: str | None) -> Path:
    """The example to run: ``given``, else ``make torchft-example``'s copy; a clear error when
    neither is there."""
    path = Path(given) if given else root / ".cache" / "upstream" / "train_ddp.py"
    if not path.is_file():
        raise click.ClickException(
            f"torchft's train_ddp.py is not at {path}: run `make torchft-example` "
            "(or pass --script with a copy from torchft's repository)"
        )
    return path


@click.command("torchft-ddp")
@click.option("--script", default=None, help="torchft's train_ddp.py [default: .cache/upstream/train_ddp.py].")
@click.option("--starts", default=1, show_default=True, help="Starts of the job.")
@click.option(
    "--fault", type=click.Choice(FAULTS), default="kill", show_default=True, help="kill -9 or SIGSTOP replica 1."
)
@click.option("--fault-step", default=4, show_default=True, help="Replica 1 is faulted as this step begins.")
@click.option("--steps-after", default=4, show_default=True, help="Steps both replicas commit after the fault.")
@click.option("--stop-s", default=20.0, show_default=True, help="With --fault stop: SIGCONT after this long.")
@click.option("--timeout-s", default=900.0, show_default=True, help="A start not at its last step after this hung.")
@click.option("--out", default="runs/bench/torchft-ddp.json", show_default=True, help="Where the JSON goes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def torchft_ddp(**kw: Any) -> None:
    """torchft's train_ddp.py example, unedited, on unbroken through a kill -9 or a SIGSTOP."""
    args: Any = types.SimpleNamespace(**kw)
    if args.fault_step < 2 or args.steps_after < 1:
        raise click.BadParameter("--fault-step must be >= 2 and --steps-after >= 1")
    root = Path(__file__).resolve().parents[3]
    script = example_script(root, args.script)
    sha = hashlib.sha256(script.read_bytes()).hexdigest()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), python_path()])))
    work = Path(args.out).with_suffix("").resolve()
    shutil.rmtree(work, ignore_errors=True)
    starts = []
    for i in range(args.starts):
        s = run_start(work / f"start-{i}", script, args, env)
        starts.append(s)
        click.echo(json.dumps({"start": i, **dataclasses.asdict(s)}), err=True)
    result: dict[str, Any] = {
        "script": str(script),
        "script_sha256": sha,
        "script_is_torchft_commit": SCRIPT_COMMIT if sha == SCRIPT_SHA256 else None,
        "fault": args.fault,
        "fault_step": args.fault_step,
        "steps_after": args.steps_after,
        "replicas": REPLICAS,
        "machine": f"{os.cpu_count()} cores, CPU",
        "unbroken": summarize(starts),
    }
    publish(result, args.out, args.as_json)
