"""``unbroken bench sdc``: flipped bits caught by the verified exchange, named and healed.

Three jobs of the example GPT under ``unbroken run`` (real processes, Gloo, CPU):

- **faults**, 3 replicas: one bit flipped at a time (``--fault bitflip``) in an exchange's
  result at one member, a weight and an optimizer moment, on different replicas, with weights
  compared every ``--weight-every`` steps; plus one flip in a gradient before it is sent, which
  every member sums alike: reported apart (``grad_flips``), as what the check cannot see;
- **pair**, 2 replicas: a flipped result with no majority to name the culprit, named by the re-run;
- **clean**, 2 replicas, ``--clean-steps`` steps unpaced with no fault: every detection there is
  false; the check's own time (fingerprints, the swap, judging) over the step time is the
  overhead, and the same job with the check off (``UNBROKEN_VERIFY_EXCHANGE=0``) gives the A/B
  ratio of median step times;
- **llama** (``--llama-steps``), the example Llama, 3 replicas of 2 FSDP2 ranks, the check off
  and on in alternate blocks of 10 steps in one job (``--check-alternate``): each on-block's
  median step over the off-blocks around it (:mod:`unbroken.bench.training.alternate`, which
  says why two separate jobs cannot time it); ``--llama-weight-every N`` compares the weights
  every N steps there.

The JSON object has ``injected`` (detectable flips), ``detected``, ``culprit_named``,
``false_detections``, ``committed_differing`` (steps that replicas committed with different
sums: must be 0), ``overhead_ratio`` and ``replicas_identical`` (every job ended bitwise
identical), with the details per job. Scoring is :func:`score`, a plain function.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.bench.training.alternate import ALTERNATE_EVERY, alternating_ratio, run_llama
from unbroken.config import ENV_VERIFY_EXCHANGE, ENV_WEIGHT_CHECK_EVERY
from unbroken.faults.schedule import Fault, parse_flag
from unbroken.observe.events import read_jsonl

Row = dict[str, Any]
TRAIN_MODULE = "unbroken.examples.gpt.train"


def fault_plan(weight_every: int) -> tuple[list[str], int]:
    """The faults job's flips and its length in steps. The flips lie ``2 * weight_every + 6``
    steps apart: each one is found and healed (a weight's by the next check, then a catch-up)
    before the next lands. A flip in a donor's state while it serves a catch-up would be copied
    to the newcomer, and the next check would then find the healthy replica in the minority
    (docs/diagnosis.md, what it cannot see); this plan measures the check, not that race."""
    gap = 2 * weight_every + 6
    kinds = [
        (1, "result", 30),
        (2, "result", 3),
        (0, "weight", 12),
        (1, "moment", 20),
        (0, "result", 22),
        (2, "weight", 31),
        (2, "grad", 22),
    ]
    plan = [f"bitflip:replica={r},step={10 + i * gap},where={w},bit={b}" for i, (r, w, b) in enumerate(kinds)]
    return plan, 10 + len(kinds) * gap + 2 * weight_every


def committed_differing(rows: Sequence[Row]) -> list[int]:
    """The steps that replicas committed with different exchange fingerprints."""
    fps: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        if r.get("committed") and r.get("exchange_fp"):
            fps[r["step"]].add(r["exchange_fp"])
    return sorted(s for s, v in fps.items() if len(v) > 1)


def findings(events: Sequence[Row]) -> dict[tuple[int, str], set[int]]:
    """(step, what) -> the replicas named, from every rank's ``sdc_detected`` events (each
    member reports the same finding)."""
    out: dict[tuple[int, str], set[int]] = defaultdict(set)
    for e in events:
        if e.get("kind") == "sdc_detected":
            out[(e["step"], e["what"])].update(e["culprits"])
    return out


def score(faults: Sequence[Fault], events: Sequence[Row], rows: Sequence[Row], weight_every: int) -> Row:
    """Which flips were detected (a result's in its step, a weight's or a moment's by the next
    weight check), which culprits named, and which findings match no flip (false)."""
    found = findings(events)
    matched: set[tuple[int, str]] = set()
    per_fault = []
    for f in faults:
        assert f.step is not None
        if f.where == "grad":
            keys = [k for k in found if k[0] == f.step]
        elif f.where == "result":
            keys = [k for k in found if k[0] == f.step and k[1] in ("results", "rerun")]
        else:
            keys = [k for k in found if k[1] == "weights" and f.step <= k[0] <= f.step + 2 * weight_every]
        named = any(found[k] == {f.replica} for k in keys)
        matched.update(keys)
        first = min((k[0] for k in keys), default=None)
        per_fault.append(
            {
                "where": f.where,
                "replica": f.replica,
                "step": f.step,
                "bit": f.bit,
                "detected": bool(keys),
                "culprit_named": named,
                "detect_steps": None if first is None else first - f.step,
            }
        )
    visible = [p for p in per_fault if p["where"] != "grad"]
    grads = [p for p in per_fault if p["where"] == "grad"]
    return {
        "injected": len(visible),
        "detected": sum(p["detected"] for p in visible),
        "culprit_named": sum(p["culprit_named"] for p in visible),
        "false_detections": len([k for k in found if k not in matched]),
        "committed_differing": len(committed_differing(rows)),
        "grad_flips": {"injected": len(grads), "detected": sum(p["detected"] for p in grads)},
        "flips": per_fault,
    }


def identical(run_dir: Path, replicas: int) -> bool:
    """Whether every replica's final model and optimizer state are the same bytes."""
    import torch

    states = [torch.load(run_dir / f"final-r{r}.pt", weights_only=False) for r in range(replicas)]
    ref = states[0]
    for s in states[1:]:
        if s["step"] != ref["step"]:
            return False
        if any(not torch.equal(v, s["model"][k]) for k, v in ref["model"].items()):
            return False
        for pid, st in ref["optim"]["state"].items():
            if any(not torch.equal(v, s["optim"]["state"][pid][k]) for k, v in st.items()):
                return False
    return True


def run_job(
    run_dir: Path, replicas: int, steps: int, faults: Sequence[str], env: dict[str, str], pace_s: float
) -> tuple[list[Row], list[Row], float]:
    """One ``unbroken run`` of the example GPT; its events, metrics rows and wall seconds."""
    cmd = [sys.executable, "-m", "unbroken", "run", "--replicas", str(replicas), "--run-dir", str(run_dir)]
    for f in faults:
        cmd += ["--fault", f]
    cmd += ["--", sys.executable, "-m", TRAIN_MODULE, "--steps", str(steps), "--pace-s", str(pace_s)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb") as log:
        code = subprocess.call(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise click.ClickException(f"the job in {run_dir} ended with code {code}; see its launcher log")
    events = list(read_jsonl(run_dir / "events.jsonl"))
    rows = [r for k in range(replicas) for r in read_jsonl(run_dir / f"metrics-r{k}.jsonl") if "step" in r]
    return events, rows, time.monotonic() - t0


def overhead(rows: Sequence[Row], skip: int = 20) -> float | None:
    """The check's own time over the step time, replica 0, after the first ``skip`` steps."""
    mine = [r for r in rows if r.get("replica") == 0 and r.get("committed") and "check_s" in r][skip:]
    if len(mine) < 2:
        return None
    step_s = sum(r["step_s"] for r in mine[1:])
    return (mine[-1]["check_s"] - mine[0]["check_s"]) / step_s if step_s > 0 else None


def median_step_s(rows: Sequence[Row], skip: int = 20) -> float | None:
    xs = [r["step_s"] for r in rows if r.get("replica") == 0 and r.get("committed")][skip:]
    return statistics.median(xs) if xs else None


@click.command()
@click.option("--weight-every", type=int, default=5, show_default=True, help="Steps between weight checks.")
@click.option("--clean-steps", type=int, default=1000, show_default=True, help="Steps of the clean job (0: none).")
@click.option("--root", type=click.Path(path_type=Path), default=Path("runs/bench/sdc"), show_default=True)
@click.option(
    "--llama-steps",
    type=int,
    default=0,
    show_default=True,
    help="Steps of the example Llama job (3 x 2 FSDP2 ranks) timing the check on and off in alternate "
    f"blocks of {ALTERNATE_EVERY} (0: none; needs the examples extra).",
)
@click.option(
    "--llama-weight-every",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Steps between weight checks in the example Llama job (0: the job's default, every 100).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/sdc.json"), show_default=True)
def sdc(
    weight_every: int,
    clean_steps: int,
    llama_steps: int,
    llama_weight_every: int,
    root: Path,
    as_json: bool,
    out: Path,
) -> None:
    """Silent data corruption: flipped bits caught in-band, named, and healed from a peer."""
    if weight_every <= 0:
        raise click.BadParameter(f"must be > 0 steps, got {weight_every}", param_hint="--weight-every")
    if clean_steps < 0:
        raise click.BadParameter(f"must be >= 0, got {clean_steps}", param_hint="--clean-steps")
    if llama_steps and llama_steps < 4 * ALTERNATE_EVERY:
        raise click.BadParameter(
            f"must be 0 or at least {4 * ALTERNATE_EVERY} steps (two off/on pairs after the first), got {llama_steps}",
            param_hint="--llama-steps",
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = {ENV_WEIGHT_CHECK_EVERY: str(weight_every), "OMP_NUM_THREADS": "1"}
    plan, steps = fault_plan(weight_every)
    events, rows, wall = run_job(root / f"{stamp}-faults", 3, steps, plan, env, pace_s=0.05)
    faults_job = score([parse_flag(f) for f in plan], events, rows, weight_every)
    faults_job |= {"replicas": 3, "steps": steps, "wall_s": round(wall, 1)}
    faults_job["identical"] = identical(root / f"{stamp}-faults", 3)
    faults_job["catch_ups"] = len([e for e in events if e["kind"] == "caught_up"])
    faults_job["restarts"] = len([e for e in events if e["kind"] == "process_started"]) - 3
    faults_job["suspects"] = [
        e["culprit"]["replica"] for e in events if e["kind"] == "verdict" and e.get("class") == "suspect_hardware"
    ]

    pair_plan = ["bitflip:replica=1,step=8,where=result,bit=30"]
    events, rows, wall = run_job(root / f"{stamp}-pair", 2, 20, pair_plan, env, pace_s=0.05)
    pair = score([parse_flag(f) for f in pair_plan], events, rows, weight_every)
    pair |= {"replicas": 2, "steps": 20, "wall_s": round(wall, 1), "identical": identical(root / f"{stamp}-pair", 2)}

    clean: Row = {"steps": clean_steps}
    if clean_steps:
        events, rows, wall = run_job(root / f"{stamp}-clean", 2, clean_steps, [], env, pace_s=0.0)
        clean |= {
            "false_detections": len(findings(events)),
            "committed_differing": len(committed_differing(rows)),
            "verified_steps": len({r["step"] for r in rows if r.get("committed") and r.get("exchange_fp")}),
            "check_share": overhead(rows),
            "median_step_s": median_step_s(rows),
            "wall_s": round(wall, 1),
            "identical": identical(root / f"{stamp}-clean", 2),
        }
        off_env = env | {ENV_VERIFY_EXCHANGE: "0"}
        _, off_rows, _ = run_job(root / f"{stamp}-clean-off", 2, clean_steps, [], off_env, pace_s=0.0)
        on, off = clean["median_step_s"], median_step_s(off_rows)
        clean["median_step_s_off"] = off
        clean["ab_ratio"] = None if not on or not off else round(on / off - 1.0, 4)

    llama: Row = {"steps": llama_steps}
    if llama_steps:
        weights = {ENV_WEIGHT_CHECK_EVERY: str(llama_weight_every)} if llama_weight_every else None
        rows, wall = run_llama(root / f"{stamp}-llama", llama_steps, "check", env=weights)
        timed = alternating_ratio(rows, ALTERNATE_EVERY)
        cpu = alternating_ratio(rows, ALTERNATE_EVERY, spent="check_cpu_s")["own_share"]
        llama |= {
            "ratio": timed["ratio"],
            "pairs": timed["pairs"],
            "ratios_p10_p90": timed["ratios_p10_p90"],
            "check_share": timed["own_share"],  # the check's own time over the on-blocks' steps
            # Its CPU on the training thread over the same: with 6 ranks on 2 cores, the
            # machine's cores spend 3 times this share of each step on it.
            "check_cpu_share": cpu,
            "weight_every": llama_weight_every or None,  # None: the job's default
            "every": ALTERNATE_EVERY,
            "wall_s": round(wall, 1),
        }

    jobs = [faults_job, pair]
    result: Row = {
        "injected": sum(j["injected"] for j in jobs),
        "detected": sum(j["detected"] for j in jobs),
        "culprit_named": sum(j["culprit_named"] for j in jobs),
        "false_detections": sum(j["false_detections"] for j in jobs) + clean.get("false_detections", 0),
        "committed_differing": sum(j["committed_differing"] for j in jobs) + clean.get("committed_differing", 0),
        "overhead_ratio": None if clean.get("check_share") is None else round(clean["check_share"], 4),
        "replicas_identical": all(j["identical"] for j in jobs) and clean.get("identical", True),
        "clean_steps": clean_steps,
        "weight_every": weight_every,
        "llama_overhead_ratio": llama.get("ratio"),
        "jobs": {"faults": faults_job, "pair": pair, "clean": clean, "llama": llama},
        "machine": {"cpus": os.cpu_count(), "note": "shared machine: other processes ran beside the jobs"},
    }
    path = publish(result, out, as_json)
    if not as_json:
        click.echo(
            f"injected {result['injected']}, detected {result['detected']}, culprit named "
            f"{result['culprit_named']}, false {result['false_detections']}, committed differing "
            f"{result['committed_differing']}, overhead {result['overhead_ratio']}, identical "
            f"{result['replicas_identical']}  ({path})"
        )
