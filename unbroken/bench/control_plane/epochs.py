"""``unbroken bench epochs``: what a process holds after hundreds of membership changes.

Every epoch builds a new cross-replica group; a flapping job builds thousands. Each member
process (:mod:`unbroken.bench.control_plane.epochs_worker`) builds, uses and leaves a group every epoch, a
fifth of them abandoned mid-collective (a member vanishes while the others' all-reduce runs),
and reports its threads, file descriptors, resident memory and, on a GPU, the device memory in
use, after a warm-up and every 100 epochs. ``--compare`` runs the same loop with every retired
group kept forever (the behaviour before groups were released) for the before/after in one run.
On a GPU one process builds one-rank NCCL groups (one device allows one NCCL rank).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.config import ENV_SECRET_FILE
from unbroken.launch.workers import package_path
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer


def churn(
    epochs: int,
    size: int,
    abort_every: int,
    device: str,
    keep: bool = False,
    timeout_s: float = 120.0,
    release: str = "reaper",
) -> dict[str, Any]:
    """Runs the loop with ``size`` member processes (one on a GPU); their reports and drifts."""
    secret = JobSecret.generate()
    store = StoreServer("127.0.0.1", secret)
    members = 1 if device.startswith("cuda") else size
    with tempfile.TemporaryDirectory(prefix="unbroken-epochs-") as tmp:
        secret_path = secret.write(Path(tmp) / "secret")
        env = {**os.environ, **package_path(), ENV_SECRET_FILE: str(secret_path), "OMP_NUM_THREADS": "1"}
        procs = []
        started = time.perf_counter()
        try:
            for rank in range(members):
                cmd = [
                    sys.executable, "-m", "unbroken.bench.control_plane.epochs_worker",
                    "--rank", str(rank), "--size", str(members),
                    "--store", store.address, "--epochs", str(epochs), "--abort-every", str(abort_every),
                    "--device", device, "--report", str(Path(tmp) / f"r{rank}.json"), "--release", release,
                ] + (["--keep"] if keep else [])  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env))
            codes = [p.wait(timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            store.close()
        if any(codes):
            raise click.ClickException(f"an epochs worker failed (exit codes {codes})")
        reports = [json.loads((Path(tmp) / f"r{r}.json").read_text()) for r in range(members)]
    return {
        "epochs": epochs,
        "members": members,
        "device": device,
        "kept_forever": keep,
        "wall_s": round(time.perf_counter() - started, 1),
        "reports": reports,
        "drift": [drift(r["rows"]) for r in reports],
        "abort_ms_median": median_or_none([ms for r in reports for ms in r["abort_ms"]]),
        "abort_ms_max": max((ms for r in reports for ms in r["abort_ms"]), default=None),
    }


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def drift(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The last row less the first (taken after the warm-up), for each holding."""
    first, last = rows[0], rows[-1]
    return {k: round(last[k] - first[k], 1) for k in first if k not in ("epoch", "s")}


@click.command()
@click.option("--epochs", type=int, default=500, show_default=True)
@click.option("--replicas", "size", type=int, default=3, show_default=True, help="Member processes (CPU).")
@click.option(
    "--abort-every", type=int, default=5, show_default=True, help="Every Nth epoch is abandoned mid-collective."
)
@click.option("--device", default="cpu", show_default=True, help="cpu (Gloo groups) or cuda (one-rank NCCL groups).")
@click.option("--compare", is_flag=True, help="Also run with every group kept forever (before the release).")
@click.option(
    "--release",
    type=click.Choice(["reaper", "inline", "serial", "unlocked"]),
    default="reaper",
    show_default=True,
    help="cuda: how a retired NCCL group is aborted: by the reaper thread (the job's way), at once on "
    "the building thread, by the reaper before the next group is built, or by the reaper with no "
    "lock against a build beside it.",
)
@click.option("--out", default="out/bench_epochs.json", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def epochs(
    epochs: int, size: int, abort_every: int, device: str, compare: bool, release: str, out: str, as_json: bool
) -> None:
    """Threads, descriptors and memory over hundreds of membership changes."""
    if epochs < 21 or size < 2:
        raise click.UsageError("--epochs must be above the 20 of the warm-up and --replicas at least 2")
    result: dict[str, Any] = {"released": churn(epochs, size, abort_every, device, release=release)}
    if compare:
        result["kept_forever"] = churn(epochs, size, abort_every, device, keep=True)
    path = publish(result, out, as_json)
    if not as_json:
        for name, run in result.items():
            click.echo(f"{name}: {run['epochs']} epochs in {run['wall_s']}s, drift per member {run['drift']}")
        click.echo(f"written to {path}")
