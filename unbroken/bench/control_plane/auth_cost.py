"""``unbroken bench auth``: what authenticating the control plane costs the training step.

Every control message is sealed once by its sender and opened once by its receiver
(HMAC-SHA256 over the line, :mod:`unbroken.wire.auth`), and every connection starts with one
handshake. The figure that matters is their share of a step: the example GPT is run for real
(``unbroken run`` in-process, two replicas) to measure its step time and how many control
lines the coordinator exchanged per replica-step (quorum, answers, heartbeats, telemetry);
seal+open and the handshake are timed in isolation; the ratio charges every line's seal and
open to the step (an upper bound: most of them are sent by a background thread, off the step's
path). Timings are meaningful only on an otherwise idle machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.wire.auth import JobSecret, _session, client_handshake, server_handshake

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "examples" / "gpt" / "train.py"
# A typical quorum answer: the longest line on the step's path.
LINE = json.dumps(
    {
        "op": "quorum",
        "id": 1234,
        "decision": {"epoch": 17, "step": 4242, "members": [0, 1, 2], "behind": [], "donors": []},
        "transfer_addrs": {"0": "127.0.0.1:40001", "1": "127.0.0.1:40002", "2": "127.0.0.1:40003"},
        "store": "127.0.0.1:40000",
    },
    separators=(",", ":"),
).encode()


def mac_cost_s(n: int = 20000) -> float:
    """Seconds to seal one control line and open it on the other side."""
    key = JobSecret.generate().key
    sender = _session(key, "coordinator", b"s" * 16, b"c" * 16, server=False)
    receiver = _session(key, "coordinator", b"s" * 16, b"c" * 16, server=True)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            receiver.open_line(sender.seal_line(LINE))
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def handshake_cost_s(n: int = 200) -> float:
    """Seconds for one mutual handshake over a local socket pair (both sides' work)."""
    secret = JobSecret.generate()
    times = []
    for _ in range(n):
        a, b = socket.socketpair()
        with a, b:
            box: dict[str, Any] = {}
            t0 = time.perf_counter()
            server = threading.Thread(
                target=lambda box=box, a=a: box.update(s=server_handshake(a, secret, "coordinator"))
            )
            server.start()
            client_handshake(b, secret, "coordinator")
            server.join()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_job(run_dir: Path, steps: int, replicas: int) -> dict[str, Any]:
    """Runs the example GPT under ``unbroken run`` (in this process) and counts control lines."""
    from unbroken.launch.run.launcher import Launcher, LaunchSettings

    launcher = Launcher(
        LaunchSettings(
            command=(sys.executable, str(TRAIN), "--steps", str(steps)),
            replicas=replicas,
            run_dir=run_dir,
            warm_spare=False,
        )
    )
    code = asyncio.run(launcher.run())
    if code != 0:
        raise click.ClickException(f"the example job failed (exit code {code}); see {run_dir}/logs")
    assert launcher.coordinator is not None
    rows = [
        json.loads(line)
        for r in range(replicas)
        for line in (run_dir / f"metrics-r{r}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    step_s = statistics.median(row["step_s"] for row in rows if row["committed"] and row["step"] >= 3)
    lines = launcher.coordinator.lines_in + launcher.coordinator.lines_out
    return {
        "step_s": step_s,
        "control_lines": lines,
        "replica_steps": len(rows),
        "lines_per_step": lines / max(1, len(rows)),
    }


@click.command()
@click.option("--steps", type=int, default=60, show_default=True, help="Steps of the example GPT to run.")
@click.option("--replicas", type=int, default=2, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/bench/auth-run"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/auth.json"), show_default=True)
def auth(steps: int, replicas: int, run_dir: Path, as_json: bool, out: Path) -> None:
    """Authentication's cost on the training step: MAC per control line, handshake, their share."""
    if steps < 10 or replicas < 1:
        raise click.UsageError("--steps must be >= 10 and --replicas >= 1")
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    click.echo(f"running the example GPT for {steps} steps on {replicas} replicas ...", err=True)
    job = run_job(run_dir, steps, replicas)
    mac_s, handshake_s = mac_cost_s(), handshake_cost_s()
    per_step_s = job["lines_per_step"] * mac_s
    result = {
        "step_s": round(job["step_s"], 6),
        "control_lines_per_step": round(job["lines_per_step"], 2),
        "mac_seal_open_us": round(mac_s * 1e6, 3),
        "handshake_us": round(handshake_s * 1e6, 1),
        "auth_per_step_us": round(per_step_s * 1e6, 3),
        "ratio": per_step_s / job["step_s"],
        "ratio_with_handshake": (per_step_s + handshake_s / max(1, steps)) / job["step_s"],
        "target_ratio": 0.01,
        "steps": steps,
        "replicas": replicas,
        "control_lines": job["control_lines"],
    }
    path = publish(result, out, as_json)
    if not as_json:
        click.echo(
            f"example GPT step: {result['step_s'] * 1e3:.2f} ms; control lines per replica-step: "
            f"{result['control_lines_per_step']}; seal+open per line: {result['mac_seal_open_us']} us; "
            f"handshake: {result['handshake_us']} us"
        )
        click.echo(
            f"auth per step: {result['auth_per_step_us']} us = {result['ratio'] * 100:.4f}% of the step "
            f"(with one handshake per run: {result['ratio_with_handshake'] * 100:.4f}%; target < 1%)"
        )
        click.echo(f"written to {path}", err=True)
