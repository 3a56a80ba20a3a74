"""``unbroken bench metrics``: what a Prometheus scraper at 1 Hz costs the training step.

The example GPT runs under ``unbroken run`` (in this process) twice per round: once serving
nothing, once with ``--http-port`` and a scraper that reads ``/metrics`` and the dashboard's
``/api/state`` every second, as Prometheus and an open browser tab would. The figure is the
ratio of the median committed step times (target: at most 1.01). Rounds alternate the two
runs so a machine getting busier does not favour one. Meaningful only on an idle machine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "examples" / "gpt" / "train.py"


def _scrape(launcher: Any, stop: threading.Event, period_s: float, counts: dict[str, int]) -> None:
    while not stop.is_set() and launcher.http is None:
        time.sleep(0.05)
    if launcher.http is None:
        return
    base, token = f"http://{launcher.http.address}", launcher.http.token
    while not stop.wait(period_s):
        for path in ("/metrics", "/api/state"):
            req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    resp.read()
                counts["ok"] += 1
            except OSError:
                counts["failed"] += 1


def run_once(run_dir: Path, steps: int, replicas: int, scrape_s: float | None) -> dict[str, Any]:
    """One run of the example; with ``scrape_s``, served and scraped at that period."""
    from unbroken.launch.run.launcher import Launcher, LaunchSettings

    shutil.rmtree(run_dir, ignore_errors=True)
    launcher = Launcher(
        LaunchSettings(
            command=(sys.executable, str(TRAIN), "--steps", str(steps)),
            replicas=replicas,
            run_dir=run_dir,
            warm_spare=False,
            http_port=0 if scrape_s is not None else None,
        )
    )
    stop, counts = threading.Event(), {"ok": 0, "failed": 0}
    scraper = None
    if scrape_s is not None:
        scraper = threading.Thread(target=_scrape, args=(launcher, stop, scrape_s, counts), daemon=True)
        scraper.start()
    try:
        code = asyncio.run(launcher.run())
    finally:
        stop.set()
        if scraper is not None:
            scraper.join(10)
    if code != 0:
        raise click.ClickException(f"the example job failed (exit code {code}); see {run_dir}/logs")
    rows = [
        json.loads(line)
        for r in range(replicas)
        for line in (run_dir / f"metrics-r{r}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    step_s = statistics.median(row["step_s"] for row in rows if row.get("committed") and row["step"] >= 3)
    return {"step_s": step_s, "scrapes": counts["ok"], "scrape_failures": counts["failed"]}


@click.command()
@click.option("--steps", type=int, default=150, show_default=True, help="Steps of the example GPT per run.")
@click.option("--replicas", type=int, default=2, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True, help="Pairs of runs (without, with the scraper).")
@click.option("--period", type=float, default=1.0, show_default=True, help="Seconds between scrapes.")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/bench/metrics-run"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/metrics.json"), show_default=True)
def metrics(steps: int, replicas: int, rounds: int, period: float, run_dir: Path, as_json: bool, out: Path) -> None:
    """The step time of the example with and without a 1 Hz /metrics scraper, and their ratio."""
    if steps < 10 or replicas < 1 or rounds < 1 or period <= 0:
        raise click.UsageError("--steps must be >= 10, --replicas and --rounds >= 1, --period > 0")
    plain, scraped, scrapes = [], [], 0
    for i in range(rounds):
        click.echo(f"round {i + 1}/{rounds}: {steps} steps on {replicas} replicas, without then with", err=True)
        plain.append(run_once(run_dir, steps, replicas, None)["step_s"])
        with_scraper = run_once(run_dir, steps, replicas, period)
        if with_scraper["scrapes"] == 0:
            raise click.ClickException("the scraper never got an answer: nothing was measured")
        scraped.append(with_scraper["step_s"])
        scrapes += with_scraper["scrapes"]
    result = {
        "step_s_without": statistics.median(plain),
        "step_s_with_scraper": statistics.median(scraped),
        "ratio": statistics.median(scraped) / statistics.median(plain),
        "target_ratio": 1.01,
        "scrapes": scrapes,
        "period_s": period,
        "steps": steps,
        "replicas": replicas,
        "rounds": rounds,
    }
    path = publish(result, out, as_json)
    if not as_json:
        click.echo(
            f"example GPT step: {result['step_s_without'] * 1e3:.2f} ms without, "
            f"{result['step_s_with_scraper'] * 1e3:.2f} ms with a scraper every {period:g} s: "
            f"ratio {result['ratio']:.4f} (target <= 1.01; {scrapes} scrapes)"
        )
        click.echo(f"written to {path}", err=True)
