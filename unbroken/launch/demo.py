"""``unbroken demo``: the example GPT as 3 replicas on CPU, one killed mid-run, and a summary.

Everything is real: the launcher and coordinator run here, the replicas are separate
processes exchanging gradients over Gloo, and the fault is a ``kill -9``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from unbroken.launch.launcher import Launcher, LaunchSettings
from unbroken.observe.events import read_events

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"


def _metrics(run_dir: Path, replica: int) -> list[dict[str, Any]]:
    path = run_dir / f"metrics-r{replica}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


async def _kill_at(launcher: Launcher, replica: int, step: int, console: Console) -> float | None:
    """Sends kill -9 to ``replica`` once replica 0 has committed ``step``."""
    for _ in range(6000):
        rows = _metrics(launcher.run_dir, 0)
        procs = launcher.replicas[replica].procs
        if rows and rows[-1]["step"] >= step and procs:
            console.print(f"[bold red]fault[/]: kill -9 replica {replica} (pid {procs[0].pid}) at step {step}")
            os.kill(procs[0].pid, signal.SIGKILL)
            return time.time()
        await asyncio.sleep(0.05)
    return None


async def _run(settings: LaunchSettings, kill_step: int, console: Console) -> tuple[int, float | None]:
    launcher = Launcher(settings)
    killer = asyncio.create_task(_kill_at(launcher, 1, kill_step, console))
    code = await launcher.run()
    killer.cancel()
    try:
        killed = await killer
    except asyncio.CancelledError:
        killed = None
    return code, killed


def summarize(run_dir: Path, replicas: int, wall_s: float, killed_at: float | None) -> dict[str, Any]:
    import torch

    events = list(read_events(run_dir / "events.jsonl"))
    survivor = _metrics(run_dir, 0)
    step_times = [r["step_s"] for r in survivor]
    median = statistics.median(step_times) if step_times else 0.0
    after = [r for r in survivor if killed_at is not None and r["t"] >= killed_at]
    finals = {r: torch.load(run_dir / f"final-r{r}.pt", weights_only=False)
              for r in range(replicas) if (run_dir / f"final-r{r}.pt").exists()}
    ref = next(iter(finals.values()), None)
    identical = bool(finals) and all(
        all(torch.equal(v, s["model"][k]) for k, v in ref["model"].items()) for s in finals.values()  # type: ignore[index]
    )
    quorums = [e for e in events if e["kind"] == "quorum"]
    rejoin = [q for q in quorums if q["behind"]]
    return {
        "wall_s": round(wall_s, 2),
        "steps": survivor[-1]["step"] + 1 if survivor else 0,
        "median_step_s": round(median, 4),
        "survivor_stall_s": round(max((r["step_s"] for r in after[:5]), default=median) - median, 3),
        "epochs": [q["epoch"] for q in quorums],
        "global_restarts": 0,
        "replica_restarts": sum(1 for e in events if e["kind"] == "replica_restarting"),
        "rejoined_at_step": rejoin[0]["step"] if rejoin else None,
        "final_loss": round(statistics.mean(r["loss"] for r in survivor[-10:]), 4) if survivor else None,
        "replicas_identical": identical,
        "faults": [{"kind": "crash", "target": "replica 1", "detected": bool(after),
                    "recovered": bool(rejoin)}] if killed_at else [],
    }


@click.command()
@click.option("--steps", type=int, default=150, show_default=True)
@click.option("--kill-step", type=int, default=40, show_default=True, help="Step at which replica 1 is killed.")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo(steps: int, kill_step: int, run_dir: Path, as_json: bool) -> None:
    """Train the example GPT as 3 replicas, kill one mid-run, and report what it cost."""
    if not TRAIN.exists():
        raise click.UsageError(f"the example is missing at {TRAIN}: run the demo from a checkout of unbroken")
    if not 0 < kill_step < steps:
        raise click.UsageError(f"--kill-step must be between 1 and --steps - 1, got {kill_step}")
    console = Console(stderr=True)
    if run_dir.exists():
        for f in run_dir.glob("*.jsonl"):
            f.unlink()
    settings = LaunchSettings(
        command=(sys.executable, str(TRAIN), "--steps", str(steps)), replicas=3, run_dir=run_dir,
    )
    console.print(f"[bold]unbroken demo[/]: 3 replicas of the example GPT, {steps} steps; logs in {run_dir}")
    t0 = time.time()
    code, killed = asyncio.run(_run(settings, kill_step, console))
    summary = summarize(run_dir, 3, time.time() - t0, killed)
    summary["exit_code"] = code
    if as_json:
        click.echo(json.dumps(summary))
    else:
        table = Table(title="what happened and what it cost")
        table.add_column("measure")
        table.add_column("value")
        for k, v in summary.items():
            table.add_row(k, str(v))
        Console().print(table)
    sys.exit(code)
