"""``unbroken demo``: 3 replicas on CPU through a crash, a hang, a flipped bit and a slow rank, then a report.

``--model gpt`` (the default, the faster) trains the example GPT, one process per replica;
``--model llama`` the example Hugging Face Llama, each replica 2 ranks sharding it with FSDP2 and
the cross-replica average in FSDP2's all-reduce hook (:mod:`unbroken.examples.llama.train`).

Everything is real: the supervisor and coordinator run here, the replicas are separate
processes exchanging gradients over Gloo, and the faults are a ``kill -9``, a ``SIGSTOP``, a bit
flipped in one member's copy of an exchange's sum (GPT only: silent data corruption, found by the
verified exchange in the step it happens and healed from a peer) and a rank that really computes
slower. The slow rank is found by a ``straggler`` verdict of the
diagnosis master in the coordinator (:mod:`unbroken.diagnosis`); the supervisor isolates its
slot and moves the replica to the spare. At the end: a summary table,
``--json``, and ``report.html`` beside a fault-free reference of the same training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from unbroken.launch.run.launcher import Launcher, LaunchSettings
from unbroken.launch.run.run_cli import supervisor_options, supervisor_settings
from unbroken.observe import goodput as gp
from unbroken.observe.events import read_events, read_jsonl

REPLICAS = 3


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """What the demo trains: the example's module (shipped inside the package, so the demo runs
    from an installed wheel too), its replica shape and a fault schedule that fits its speed."""

    title: str
    module: str
    ranks_per_replica: int
    steps: int
    faults: tuple[str, ...]
    has_reference: bool  # the fault-free reference can be computed in one process
    # Silence before a replica counts as hung. A Llama rank holds the GIL for seconds at a time
    # while it imports transformers and torch's compiler stack after connecting: at 1 s every
    # replica was restarted as hung before its first step (seen on a busy 2-core machine).
    heartbeat_timeout_s: float


MODELS = {
    "gpt": DemoModel(
        title="GPT",
        module="unbroken.examples.gpt.train",
        ranks_per_replica=1,
        steps=300,
        faults=(
            "crash:replica=1,step=50",
            "bitflip:replica=0,step=90,where=result,bit=30",
            "hang:replica=2,step=130",
            "slow_rank:replica=0,factor=4,step=210,duration_s=20",
        ),
        has_reference=True,
        heartbeat_timeout_s=1.0,
    ),
    "llama": DemoModel(
        title="Llama",
        module="unbroken.examples.llama.train",
        ranks_per_replica=2,
        steps=120,
        faults=(
            "crash:replica=1,rank=1,step=25",
            "bitflip:replica=0,rank=1,step=40,where=result,bit=30",
            "hang:replica=2,step=55",
            "slow_rank:replica=0,factor=3,step=85,duration_s=40",
        ),
        has_reference=False,
        heartbeat_timeout_s=4.0,
    ),
}


def _metrics(run_dir: Path, replica: int) -> list[dict[str, Any]]:
    """A replica's step records (the Llama example's file also holds a 'ready' line per process)."""
    return [row for row in read_jsonl(run_dir / f"metrics-r{replica}.jsonl") if "step" in row]


async def _progress(launcher: Launcher, console: Console, steps: int) -> None:
    """One line every two seconds: the job's step and every replica's state."""
    while True:
        await asyncio.sleep(2.0)
        states = " ".join(f"r{r}={s.value}" for r, s in launcher.lifecycle.state.items())
        console.print(f"  step {launcher.job_step:>4}/{steps}  {states}", highlight=False)


async def _run(settings: LaunchSettings, console: Console, steps: int) -> int:
    launcher = Launcher(settings)
    ticker = asyncio.create_task(_progress(launcher, console, steps))
    try:
        return await launcher.run()
    finally:
        ticker.cancel()


def reference_losses(steps: int, batch_size: int = 16, lr: float = 3e-3) -> list[float]:
    """The fault-free run, computed in one process: 3 replicas' gradients averaged, as the job does."""
    import torch

    from unbroken.examples.gpt.bigram_text import batch, make_corpus
    from unbroken.examples.gpt.gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)  # more threads than free cores makes small kernels crawl
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    corpus = make_corpus(cfg.vocab_size, seed=1234)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for r in range(REPLICAS):
            x, y = batch(corpus, step, r, REPLICAS, batch_size, cfg.block_size)
            loss = model(x, y) / REPLICAS
            loss.backward()
            losses.append(loss.item() * REPLICAS)
        opt.step()
        out.append(losses[0])
    return out


def global_restarts(events: list[dict[str, Any]]) -> int:
    """Times after training began that no replica was training (what a global restart is)."""
    state: dict[int, str] = {}
    began, count, down = False, 0, False
    for e in events:
        if e["kind"] != "replica_state":
            continue
        state[e["replica"]] = e["new"]
        began = began or e["new"] == "training"
        if not began or any(s == "finished" for s in state.values()):
            continue
        now_down = not any(s in ("training", "catching_up") for s in state.values())
        count += now_down and not down
        down = now_down
    return count


def fault_outcomes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per injected fault: was it detected, blamed on the right replica and rank, recovered from?"""
    out = []
    for f, hit in gp.detections(events):
        target = f.get("replica")
        row: dict[str, Any] = {
            "kind": f["fault_kind"],
            "target": f["target"],
            "detected": hit is not None,
            "attributed_correctly": False,
            "recovered": False,
            "detect_s": None,
            "detected_by": None,
        }
        if hit is not None:
            if hit["kind"] == "sdc_detected":  # reported by a member; names the culprit replicas
                named = hit.get("culprits") or []
                culprit = {"replica": named[0] if len(named) == 1 else None, "rank": None}
            else:
                culprit = hit.get("culprit") or {"replica": hit.get("replica"), "rank": hit.get("rank")}
            row["detect_s"] = round(hit["t"] - f["t"], 3)
            row["detected_by"] = hit["kind"] + (f" ({hit.get('class')})" if hit["kind"] == "verdict" else "")
            row["attributed_correctly"] = culprit.get("replica") == target and culprit.get("rank") in (
                None,
                f.get("rank"),
            )
            if target is None:  # the coordinator's: recovered once an epoch is served again (resumed or new)
                row["recovered"] = any(e["kind"] in ("quorum", "epoch_resumed") and e["t"] >= hit["t"] for e in events)
            else:
                # Back to training, or (a flipped bit) healed from a peer without a restart.
                row["recovered"] = any(
                    e["replica"] == target
                    and e["t"] > hit["t"]
                    and (e["kind"] == "caught_up" or (e["kind"] == "replica_state" and e["new"] == "training"))
                    for e in events
                    if e["kind"] in ("replica_state", "caught_up")
                )
        out.append(row)
    return out


def replicas_identical(run_dir: Path) -> bool:
    """Whether every replica ended at the same step with the same state: the GPT example's final
    states (``final-r{R}.pt``), or the Llama example's digests of every rank's shards
    (``digest-r{R}.json``)."""
    import torch

    finals = {
        r: torch.load(run_dir / f"final-r{r}.pt", weights_only=True)  # plain tensors and numbers: no pickle of code
        for r in range(REPLICAS)
        if (run_dir / f"final-r{r}.pt").exists()
    }
    if finals:
        ref = next(iter(finals.values()))
        return len(finals) >= 2 and all(
            s["step"] == ref["step"] and all(torch.equal(v, s["model"][k]) for k, v in ref["model"].items())
            for s in finals.values()
        )
    digests = [
        (d["step"], d["digest"])
        for r in range(REPLICAS)
        if (run_dir / f"digest-r{r}.json").exists()
        for d in [json.loads((run_dir / f"digest-r{r}.json").read_text())]
    ]
    return len(digests) >= 2 and len(set(digests)) == 1


def summarize(
    run_dir: Path, wall_s: float, reference: list[float] | None, checkpoint_dir: Path | None = None
) -> dict[str, Any]:
    from unbroken.checkpoint.storage.disk import complete_steps

    events = list(read_events(run_dir / "events.jsonl"))
    events.sort(key=lambda e: e["t"])
    metrics = {r: _metrics(run_dir, r) for r in range(REPLICAS)}
    account = gp.account(events, metrics, REPLICAS)
    identical = replicas_identical(run_dir)
    rows = [row for rs in metrics.values() for row in rs if row["committed"]]
    by_step: dict[int, float] = {}
    for row in rows:
        by_step.setdefault(row["step"], row["loss"])
    last = sorted(by_step)[-10:]
    decision_ms = [e["decision_ms"] for e in events if e["kind"] == "restart_decision"]
    summary: dict[str, Any] = {
        "wall_s": round(wall_s, 2),
        "goodput": round(account.goodput, 4),
        "goodput_detail": account.to_json(),
        "global_restarts": global_restarts(events),
        "faults": fault_outcomes(events),
        "steps": max(by_step) + 1 if by_step else 0,
        "replica_restarts": sum(1 for e in events if e["kind"] == "replica_restarting"),
        "nodes_isolated": [e["node"] for e in events if e["kind"] == "node_isolated"],
        "nodes_readmitted": [e["node"] for e in events if e["kind"] == "node_readmitted"],
        "epochs": len([e for e in events if e["kind"] == "quorum"]),
        "max_decision_ms": round(max(decision_ms), 3) if decision_ms else None,
        "final_loss": round(statistics.mean(by_step[s] for s in last), 4) if last else None,
        "reference_final_loss": round(statistics.mean(reference[-10:]), 4) if reference else None,
        "replicas_identical": identical,
        "checkpoints_on_disk": complete_steps(str(checkpoint_dir)) if checkpoint_dir else [],
        "verdict_source": sorted(
            {(e.get("evidence") or {}).get("detector", e["source"]) for e in events if e["kind"] == "verdict"}
        ),
    }
    return summary


@click.command()
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default="gpt",
    show_default=True,
    help="The example GPT (one process per replica), or the example Llama (2 FSDP2 ranks per replica, "
    "needs the examples extra).",
)
@click.option("--steps", type=int, default=None, help="[default: 300 for gpt, 120 for llama]")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default=None, help="[default: RUN_DIR/report.html]")
@click.option("--no-reference", is_flag=True, help="Skip the fault-free reference run (no loss comparison).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option(
    "--http-port",
    type=int,
    default=0,
    show_default=True,
    help="Port of the live dashboard and /metrics on 127.0.0.1 (0: a free one); its URL is printed.",
)
@supervisor_options
def demo(
    model: str,
    steps: int | None,
    run_dir: Path,
    report: Path | None,
    no_reference: bool,
    as_json: bool,
    http_port: int,
    **kw: Any,
) -> None:
    """Train an example model as 3 replicas through a crash, a hang, a bit flip and a slow rank; report the cost.

    Without --fault/--faults-file the default schedule runs. GPT: crash of replica 1 at step 50,
    a bit flipped in replica 0's copy of step 90's sum, hang of replica 2 at step 130, replica 0
    four times slower from step 210 for 20 s. Llama:
    crash of rank 1 of replica 1 at step 25 (its whole group restarts), hang of replica 2 at step
    55, replica 0 three times slower from step 85 for 40 s.
    """
    chosen = MODELS[model]
    steps = chosen.steps if steps is None else steps
    if steps < 20:
        raise click.UsageError(f"--steps must be >= 20, got {steps}")
    if model == "llama":
        from unbroken.extras import MissingExtra, require

        try:
            require("transformers", "examples", "unbroken demo --model llama")
        except MissingExtra as e:
            raise click.ClickException(str(e)) from e
        no_reference = True  # no one-process reference of a sharded model; the summary says so
    if not kw["faults"] and not kw["fault_files"]:
        kw["faults"] = chosen.faults
        kw["spares"] = kw["spares"] or 1
    if kw["readmit_after"] == 30.0:
        kw["readmit_after"] = 10.0
    kw["checkpoint_dir"] = kw["checkpoint_dir"] or run_dir / "checkpoints"  # wiped with RUN_DIR below
    try:
        extra = supervisor_settings(kw)
        late = [f.label for f in extra["schedule"] if f.step is not None and f.step >= steps]
        if late:
            raise ValueError(f"these faults would fire after the last step ({steps}): {', '.join(late)}")
        settings = LaunchSettings(
            command=(sys.executable, "-m", chosen.module, "--steps", str(steps)),
            replicas=REPLICAS,
            ranks_per_replica=chosen.ranks_per_replica,
            run_dir=run_dir,
            heartbeat_timeout_s=chosen.heartbeat_timeout_s,
            http_port=http_port,
            **extra,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    console = Console(stderr=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    console.print(
        f"[bold]unbroken demo[/]: {REPLICAS} replicas of the example {chosen.title}"
        f"{f' ({chosen.ranks_per_replica} ranks each)' if chosen.ranks_per_replica > 1 else ''}, {steps} steps, "
        f"{settings.spares} spare slot(s); logs in {run_dir}"
    )
    for f in settings.schedule:
        console.print(f"  scheduled: {f.label}")
    t0 = time.time()
    os.umask(0o077)  # as `unbroken run`: the run's files are the job's own
    code = asyncio.run(_run(settings, console, steps))
    wall = time.time() - t0
    reference = None
    if not no_reference:
        cache = run_dir.parent / f"demo-reference-{steps}.json"  # deterministic: computed once per --steps
        if cache.exists():
            reference = json.loads(cache.read_text())
        else:
            console.print("fault-free reference of the same training (one process, same batches) ...")
            reference = reference_losses(steps)
            cache.write_text(json.dumps(reference))
    summary = summarize(run_dir, wall, reference, settings.checkpoint_dir)
    summary["model"] = model
    if not chosen.has_reference:
        summary["reference_final_loss"] = "none: no one-process reference of a sharded model"
    summary["exit_code"] = code
    report = report or run_dir / "report.html"
    from unbroken.observe.report import write_report

    left_out = write_report(report, run_dir, summary, reference, REPLICAS)
    if left_out is not None:
        console.print(f"report without plots: {left_out}", markup=False, soft_wrap=True)
    summary["report"] = str(report)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print(summary)
    sys.exit(code)


def _print(summary: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="faults: detected, attributed, recovered")
    for col in ("kind", "target", "detected", "attributed_correctly", "recovered", "detect_s", "detected_by"):
        table.add_column(col)
    for f in summary["faults"]:
        table.add_row(
            *(
                str(f[c])
                for c in ("kind", "target", "detected", "attributed_correctly", "recovered", "detect_s", "detected_by")
            )
        )
    console.print(table)
    table = Table(title="what it cost")
    table.add_column("measure")
    table.add_column("value")
    for k, v in summary.items():
        if k not in ("faults", "goodput_detail"):
            table.add_row(k, str(v))
    for k, v in summary["goodput_detail"]["lost_s"].items():
        table.add_row(f"lost replica-s: {k}", str(v))
    console.print(table)
