"""A switch's cost timed inside one job: off, then on, in alternate blocks of steps.

Two jobs of the example Llama (6 processes on a shared 2-core machine), one with a feature and
one without, differ by more than a feature of 1% costs: the same job's median step moved from
0.41 to 0.56 s within an hour. The example's ``--check-alternate N`` and ``--recorder-alternate
N`` (and the benchmark MLP's ``--recorder-alternate N``) switch the verified exchange or the
flight recorder off and on every N steps, at the same steps in every replica, and its
``--plain-alternate N`` switches between plain HSDP and unbroken's whole step;
:func:`alternating_ratio` compares each on-block with the off-blocks around it, so a drift of
the machine's load cancels.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from unbroken.observe.events import read_jsonl

Row = dict[str, Any]
LLAMA_MODULE = "unbroken.examples.llama.train"
MLP_MODULE = "unbroken.bench.training.recovery_worker"
ALTERNATE_EVERY = 10  # steps of each block with the switch off, then on
SWITCHES = ("check", "recorder", "plain")


def alternating_ratio(
    rows: Sequence[Row], every: int, flag: str = "checked", spent: str | None = "check_s"
) -> dict[str, Any]:
    """A switch's cost from one job that ran with it off, then on, in blocks of ``every`` steps
    (``flag``: the row's field saying whether it was on in that step).

    Per replica (rank 0's rows), each on-block's median step over the mean of the medians of
    the off-blocks on either side (so a steady drift of the machine cancels; the one before
    alone for a last on-block), the first step of every block left out (it switches) and the
    first pair too (warm-up); the figure is the median of those ratios over blocks and replicas.
    ``own_share``: the cumulative ``spent`` field's growth (the check's own time) over the step
    time in the on-blocks, where the rows have it (None: the switch records no own time).
    """
    ratios: list[float] = []
    own = step_total = 0.0
    by_replica: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        if r.get("committed") and flag in r:
            by_replica[r.get("replica", 0)].append(r)
    for mine in by_replica.values():
        blocks: dict[int, list[float]] = defaultdict(list)
        previous: Row | None = None
        for r in sorted(mine, key=lambda r: r["step"]):
            if r["step"] % every:
                blocks[r["step"] // every].append(r["step_s"])
                if spent is not None and r[flag] and previous is not None and previous[flag] and spent in r:
                    own += r[spent] - previous[spent]
                    step_total += r["step_s"]
            previous = r
        for b in range(3, max(blocks, default=0) + 1, 2):  # on-blocks are the odd ones
            if blocks.get(b) and blocks.get(b - 1):
                around = [statistics.median(blocks[k]) for k in (b - 1, b + 1) if blocks.get(k)]
                ratios.append(statistics.median(blocks[b]) / statistics.fmean(around))
    return {
        "ratio": round(statistics.median(ratios), 4) if ratios else None,
        "pairs": len(ratios),
        "ratios_p10_p90": [round(x, 4) for x in _p10_p90(ratios)],
        "own_share": round(own / step_total, 4) if step_total else None,
    }


def _p10_p90(xs: Sequence[float]) -> list[float]:
    if len(xs) < 2:
        return list(xs)
    q = statistics.quantiles(xs, n=10)
    return [q[0], q[-1]]


def run_llama(
    run_dir: Path,
    steps: int,
    switch: str,
    every: int = ALTERNATE_EVERY,
    device: str = "cpu",
    ranks: int = 2,
    env: Mapping[str, str] | None = None,
) -> tuple[list[Row], float]:
    """The example Llama, 3 replicas of ``ranks`` FSDP2 ranks under ``unbroken run``, ``switch``
    (``check``: the verified exchange, ``recorder``: the flight recorder and its shipments,
    ``plain``: unbroken's whole step, plain HSDP in the off-blocks) off and on in alternate blocks
    of ``every`` steps, on ``device`` (``cuda``: the replicas share the machine's GPUs); ``env``
    adds to the job's environment."""
    if switch not in SWITCHES:
        raise ValueError(f"switch must be one of {', '.join(SWITCHES)}, got {switch!r}")
    cmd = [sys.executable, "-m", "unbroken", "run", "--replicas", "3", "--ranks-per-replica", str(ranks)]
    cmd += ["--run-dir", str(run_dir), "--on-verdict", "ignore", "--", sys.executable, "-m", LLAMA_MODULE]
    cmd += ["--steps", str(steps), "--device", device, "--samples-per-replica", "4", "--seq-len", "64"]
    cmd += [f"--{switch}-alternate", str(every)]
    return _launch(cmd, run_dir, "metrics", env=env)


def run_mlp(run_dir: Path, steps: int, params_m: float = 3.0, every: int = ALTERNATE_EVERY) -> tuple[list[Row], float]:
    """``bench recovery``'s MLP, 3 replicas of one rank under ``unbroken run``, the flight recorder
    and its shipments off and on in alternate blocks of ``every`` steps."""
    cmd = [sys.executable, "-m", "unbroken", "run", "--replicas", "3", "--run-dir", str(run_dir)]
    cmd += ["--on-verdict", "ignore", "--", sys.executable, "-m", MLP_MODULE, "--mode", "unbroken"]
    cmd += ["--params-m", str(params_m), "--steps", str(steps), "--out", str(run_dir)]
    cmd += ["--recorder-alternate", str(every)]
    return _launch(cmd, run_dir, "steps")


def _launch(
    cmd: list[str], run_dir: Path, rows_name: str, replicas: int = 3, env: Mapping[str, str] | None = None
) -> tuple[list[Row], float]:
    """Runs ``cmd`` (an ``unbroken run``), its output in a launcher log beside ``run_dir``; every
    replica's step rows (``{rows_name}-r{R}.jsonl``, tagged with ``replica``) and the wall seconds."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb") as log:
        code = subprocess.call(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
    if code != 0:
        raise click.ClickException(f"the job in {run_dir} ended with code {code}; see its launcher log")
    rows = [
        r | {"replica": k}
        for k in range(replicas)
        for r in read_jsonl(run_dir / f"{rows_name}-r{k}.jsonl")
        if "step" in r
    ]
    return rows, time.monotonic() - t0
