"""``unbroken bench recovery``: what a crash and a hang cost the survivors, and what unbroken costs without faults.

Four kinds of run of the same MLP loop (:mod:`unbroken.bench.training.recovery_worker`), all real
processes on this machine:

- ``baseline``: a plain ``torch.distributed`` all-reduce, no unbroken (torchrun-style);
- ``steady``: unbroken's launcher, coordinator and step protocol, no faults;
- ``crash``: one replica is ``kill -9``-ed mid-run, restarted, and catches up from a donor;
- ``hang``: one replica is ``SIGSTOP``-ped, routed around, then ``SIGCONT``-ed and rejoins;
- ``torchft``: the same DDP loop written against torchft's API on unbroken's facade
  (``unbroken.torchft``) against ``unbroken.DistributedDataParallel``, ABBA: the facade's cost;
- ``ddp``: ``unbroken.DistributedDataParallel`` against ``torch.nn.parallel.DistributedDataParallel``
  (both Gloo on CPU) on the MLP and on the example GPT: their step-time ratio, and how much of the
  exchange the backward pass hid (1 - the wait left at the end of backward / the time the
  backend spent exchanging).

``--api ddp`` runs steady, crash and hang with the DDP wrapper instead of ``unbroken.Optimizer``.

``--model llama --ranks-per-replica 2`` runs steady, crash and hang on the example Llama
(:mod:`unbroken.examples.llama.train`: FSDP2 over each replica's ranks, the cross-replica average
in FSDP2's all-reduce hook through ``manager.process_group()``, ``constant_global_batch`` data).
Its baseline is the same script with ``--plain``: the same FSDP2 model and hook with a plain Gloo
all-reduce over the replicas (torch's HSDP), so ``overhead_ratio`` is the cost of the
fault-tolerant hook. The crash kills one rank of the victim replica (its group restarts); the
result adds ``samples_skipped`` and ``samples_repeated`` from the job's data account.

Baseline and steady alternate (``--rounds``), in ABBA order (:func:`pair_order`), so that a
busy or drifting machine slows both alike; ``overhead_ratio`` is the median over rounds of each
round's ratio of median step times (:func:`paired_ratio`), ``ratio_of_medians`` the ratio of the
medians over all rounds (this benchmark's figure before ABBA rounds). Where the worker records
its training thread's CPU time per step (the Llama example's ``cpu_s``), ``train_cpu_ratio``
compares that too. The figures are computed by the pure functions below from the per-step JSON
lines the workers write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.bench.training.alternate import ALTERNATE_EVERY, alternating_ratio, run_llama
from unbroken.launch.run.launcher import Launcher, LaunchSettings, free_port
from unbroken.observe.events import read_jsonl

Row = dict[str, Any]
WARMUP_STEPS = 5
SCENARIOS = ("steady", "crash", "hang", "ddp", "torchft")
DDP_MODELS = ("mlp", "gpt")
LOCAL_STEPS = 6
LLAMA_ARGS = ("--samples-per-replica", "4", "--seq-len", "64")  # small steps: 6 ranks share the machine


# -- pure analysis ---------------------------------------------------------------------------


def read_rows(path: Path) -> list[Row]:
    """A worker's step records; a line still being written is skipped, not an error."""
    return list(read_jsonl(path))


def step_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if "step_s" in r]


def ready_times(rows: list[Row]) -> list[float]:
    return [r["t"] for r in rows if r.get("event") == "ready"]


def median_step(rows_by_replica: dict[int, list[Row]], before: float | None = None, key: str = "step_s") -> float:
    """Median of ``key`` (the step time) over all replicas' committed steps after warm-up (and
    before ``before``)."""
    times = [
        r[key]
        for rows in rows_by_replica.values()
        for r in step_rows(rows)
        if r.get("committed") and r["step"] >= WARMUP_STEPS and (before is None or r["t1"] < before) and key in r
    ]
    if not times:
        raise ValueError(f"no steady steps with {key!r} recorded: raise --steps")
    return statistics.median(times)


def has_field(rows_by_replica: dict[int, list[Row]], key: str) -> bool:
    return any(key in r for rows in rows_by_replica.values() for r in step_rows(rows))


@dataclasses.dataclass(frozen=True)
class FaultFigures:
    """What one injected fault cost, from the workers' step records."""

    survivor_stall_s: float
    worst_survivor_step_s: float
    median_step_s: float
    rejoin_steps: int | None
    donor_slowdown: float | None
    catch_up_step: int | None
    non_donor_slowdown: float | None = None
    donor_snapshot_s: float | None = None  # the donor's training thread's part of the snapshot
    donor_snapshot_early: bool | None = None  # taken at the step's start (the coordinator's hint)
    fetch_s: float | None = None  # the newcomer's fetch, quorum answer to last byte
    catch_up_excess_s: float | None = None  # survivors' extra time over the catch-up step and the 2 after
    worst_rejoin_step_s: float | None = None  # survivors' longest step of the rejoin (see fault_figures)
    worst_rejoin_ratio: float | None = None  # that step over the median step before the fault
    # The same figure for windows of as many steps with no fault (before it): the machine's own
    # spread, which the rejoin's figure is read against (median and 90th percentile of windows).
    clean_window_ratio_p50: float | None = None
    clean_window_ratio_p90: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def fault_figures(
    rows_by_replica: dict[int, list[Row]], victim: int, fault_t: float, resumed_t: float | None = None
) -> FaultFigures:
    """Survivor stall, rejoin steps and donor slowdown around a fault at ``fault_t``.

    - stall: the longest survivor step that ended after the fault, minus the median step
      before it; the steps of the rejoin count too, since the survivors pay for them.
    - rejoin steps: survivor-committed steps from the moment the victim could train again
      (a restarted process reported ready; else ``resumed_t``, when a hung process continued)
      to the first step it contributed to (2 when it joins at the next step boundary:
      the step in flight, then its zero-gradient step).
    - donor slowdown: the donor's step time while it served the catch-up, over the median of
      its own ``LOCAL_STEPS`` steps before it; the non-donor slowdown is the same ratio for a
      survivor that served nothing (on one shared machine every survivor pays for the
      transfer's CPU and memory traffic, whoever serves it). The donor snapshot time is what
      taking the snapshot cost the donor's training thread (the bulk is copied beside it).
    - catch-up excess: each survivor's step time above the median over the catch-up step and
      the two after it, averaged over survivors: the whole cost of a catch-up on this machine,
      wherever it lands (a fetch that outlasts the step makes the next step wait for it).
    - worst rejoin step: the survivors' longest step of the rejoin, from the moment the victim
      could train again through the two steps after the catch-up step, and its ratio to the
      median. Unlike the worst step after the fault, it leaves out the step the fault itself
      broke (a survivor waits for the eviction there) and the noise of the later steps.
    - clean window ratio: the same longest-over-median for every window of as many steps before
      the fault (:func:`clean_window_ratios`): what the rejoin's figure would read with no rejoin.
    """
    survivors = {r: rows for r, rows in rows_by_replica.items() if r != victim}
    median = median_step(survivors, before=fault_t)
    after = [r for rows in survivors.values() for r in step_rows(rows) if r["t1"] > fault_t]
    worst = max((r["step_s"] for r in after), default=median)

    victim_rows = rows_by_replica.get(victim, [])
    # A restarted process says when it is ready; a hung one that was left alive resumes at SIGCONT.
    readies = [t for t in ready_times(victim_rows) if t > fault_t] or ([resumed_t] if resumed_t is not None else [])
    caught_up = [
        r for r in step_rows(victim_rows) if r["t1"] > fault_t and r.get("committed") and victim in r.get("behind", [])
    ]
    catch_up_step = caught_up[0]["step"] if caught_up else None
    rejoin_steps = None
    donor_slowdown = non_donor_slowdown = donor_snapshot_s = donor_snapshot_early = fetch_s = excess = None
    worst_rejoin: float | None = None
    if readies and catch_up_step is not None:
        first_contributing = catch_up_step + 1
        committed_after_ready = {
            r["step"]
            for rows in survivors.values()
            for r in step_rows(rows)
            if r.get("committed") and r["t1"] > readies[-1] and r["step"] < first_contributing
        }
        rejoin_steps = len(committed_after_ready)
        fetch_s = caught_up[0].get("fetch_s")
        excesses = []
        for rows in survivors.values():
            by_step = {r["step"]: r["step_s"] for r in step_rows(rows) if r.get("committed")}
            window = [by_step[s] for s in range(catch_up_step, catch_up_step + 3) if s in by_step]
            if len(window) == 3:
                excesses.append(sum(t - median for t in window))
        excess = statistics.mean(excesses) if excesses else None
        rejoin = [
            r["step_s"]
            for rows in survivors.values()
            for r in step_rows(rows)
            if r["t1"] > readies[-1] and r["step"] <= catch_up_step + 2
        ]
        worst_rejoin = max(rejoin, default=None)
        rejoin_steps_seen = {
            r["step"]
            for rows in survivors.values()
            for r in step_rows(rows)
            if r["t1"] > readies[-1] and r["step"] <= catch_up_step + 2
        }
        clean = clean_window_ratios(survivors, fault_t, len(rejoin_steps_seen), median)
        for rows in survivors.values():
            at = [r for r in step_rows(rows) if r["step"] == catch_up_step]
            if not at:
                continue
            # Against the survivor's own steps just before: on a shared machine the load drifts
            # over a run, and the question is what the catch-up cost, not what the neighbours did.
            before = [
                r["step_s"]
                for r in step_rows(rows)
                if r.get("committed") and catch_up_step - LOCAL_STEPS <= r["step"] < catch_up_step
            ]
            reference = statistics.median(before) if len(before) >= 3 else median
            ratio = at[0]["step_s"] / reference
            if at[0].get("donor"):
                donor_slowdown = max(donor_slowdown or 0.0, ratio)
                if "snapshot_s" in at[0]:
                    donor_snapshot_s = max(donor_snapshot_s or 0.0, at[0]["snapshot_s"])
                if "snapshot_early" in at[0]:
                    donor_snapshot_early = bool(at[0]["snapshot_early"])
            else:  # the same step of a survivor that served nothing: what the machine, not serving, cost
                non_donor_slowdown = max(non_donor_slowdown or 0.0, ratio)
    return FaultFigures(
        survivor_stall_s=max(0.0, worst - median),
        worst_survivor_step_s=worst,
        median_step_s=median,
        rejoin_steps=rejoin_steps,
        donor_slowdown=donor_slowdown,
        catch_up_step=catch_up_step,
        non_donor_slowdown=non_donor_slowdown,
        donor_snapshot_s=donor_snapshot_s,
        donor_snapshot_early=donor_snapshot_early,
        fetch_s=fetch_s,
        catch_up_excess_s=excess,
        worst_rejoin_step_s=worst_rejoin,
        worst_rejoin_ratio=None if worst_rejoin is None else worst_rejoin / median,
        clean_window_ratio_p50=statistics.median(clean) if readies and catch_up_step is not None and clean else None,
        clean_window_ratio_p90=_p90(clean) if readies and catch_up_step is not None and clean else None,
    )


def clean_window_ratios(survivors: dict[int, list[Row]], fault_t: float, steps: int, median: float) -> list[float]:
    """For every run of ``steps`` consecutive steps the survivors committed before the fault (the
    first :data:`WARMUP_STEPS` left out), their longest step over ``median``."""
    if steps < 1 or median <= 0:
        return []
    by_step: dict[int, list[float]] = {}
    for rows in survivors.values():
        for r in step_rows(rows):
            if r.get("committed") and r["t1"] <= fault_t and r["step"] >= WARMUP_STEPS:
                by_step.setdefault(r["step"], []).append(r["step_s"])
    ordered = sorted(by_step)
    out = []
    for i in range(len(ordered) - steps + 1):
        window = ordered[i : i + steps]
        if window[-1] - window[0] == steps - 1:  # consecutive steps only
            out.append(max(t for s in window for t in by_step[s]) / median)
    return out


def _p90(xs: list[float]) -> float:
    return xs[0] if len(xs) < 2 else statistics.quantiles(xs, n=10)[-1]


def sample_account(rows_by_replica: dict[int, list[Row]]) -> dict[str, int]:
    """The job's data account after its last committed step (the same on every replica: each
    continues its donor's): samples no replica trained, and samples trained twice."""
    last = [r for rows in rows_by_replica.values() for r in step_rows(rows) if r.get("committed")]
    if not last:
        return {}
    final = max(last, key=lambda r: r["step"])
    return {"samples_skipped": int(final["samples_skipped"]), "samples_repeated": int(final["samples_repeated"])}


def read_digests(run_dir: Path, replicas: int) -> list[dict[str, Any]]:
    """What each replica's worker wrote when it finished (replicas that did not, left out)."""
    paths = (run_dir / f"digest-r{r}.json" for r in range(replicas))
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def digests_identical(run_dir: Path, replicas: int) -> bool:
    """True when every replica finished at the same step with the same state digest."""
    found = read_digests(run_dir, replicas)
    return len(found) == replicas and len({(d["step"], d["digest"]) for d in found}) == 1


def serving_figures(run_dir: Path, replicas: int, median_step_s: float) -> dict[str, Any]:
    """What the donor's serving thread spent on the catch-up: wall and CPU seconds, and that CPU
    as a share of one step (the donor's own cost, apart from what the machine's load adds)."""
    served = [x for d in read_digests(run_dir, replicas) for x in d.get("served", [])]
    if not served:
        return {}
    cpu = sum(x["cpu_s"] for x in served)
    return {
        "serve_s": round(sum(x["s"] for x in served), 4),
        "serve_cpu_s": round(cpu, 4),
        "serve_mb": round(sum(x["bytes"] for x in served) / 1e6, 1),
        "serve_cpu_step_share": round(cpu / median_step_s, 4) if median_step_s > 0 else None,
        **{
            f"serve_{phase}": round(sum(x[phase] for x in served), 4)
            for phase in ("handshake_s", "wait_s", "send_s")
            if all(phase in x for x in served)
        },
    }


# -- running the jobs ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    replicas: int
    params_m: float
    steps: int
    fault_step: int
    hang_s: float
    root: Path
    api: str = "unbroken"  # the worker mode of steady, crash and hang: "unbroken" or "ddp"
    model: str = "mlp"  # of steady, crash and hang: "mlp" (recovery_worker) or "llama" (the example)
    ranks: int = 1  # ranks per replica
    device: str = "cpu"  # where the llama trains (--model llama); the MLP trains on the CPU
    batch_size: int = 32  # of the MLP: compute per step at the same exchange size
    alternate_steps: int = 0  # of the Llama: one job alternating plain HSDP and unbroken (see run_alternate)

    @property
    def processes(self) -> int:
        return self.replicas * self.ranks

    def worker(self, mode: str, out: Path, model: str = "mlp") -> tuple[str, ...]:
        if model == "llama":
            plain = (
                ("--plain", "--ranks-per-replica", str(self.ranks), "--run-dir", str(out)) if mode == "baseline" else ()
            )
            return (
                sys.executable,
                "-m",
                "unbroken.examples.llama.train",
                "--steps",
                str(self.steps),
                "--log-name",
                "steps",
                "--device",
                self.device,
                *LLAMA_ARGS,
                *plain,
            )
        return (
            sys.executable,
            "-m",
            "unbroken.bench.training.recovery_worker",
            "--mode",
            mode,
            "--model",
            model,
            "--params-m",
            str(self.params_m),
            "--batch-size",
            str(self.batch_size),
            "--steps",
            str(self.steps),
            "--out",
            str(out),
        )


def _threads(replicas: int) -> str:
    return str(max(1, (os.cpu_count() or 1) // replicas))


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_baseline(s: BenchSettings, out: Path, mode: str = "baseline", model: str = "mlp") -> dict[int, list[Row]]:
    """The loop with a plain all-reduce (or torch's DDP): one rank per replica, started like torchrun would."""
    import subprocess

    port = free_port()
    procs = []
    world = s.processes if model == "llama" else s.replicas
    try:
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),  # all on this machine, sharing its GPUs (as torchrun says)
                "OMP_NUM_THREADS": _threads(world),
            }
            log = open(out / f"baseline-{rank}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    s.worker(mode, out, model), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise click.ClickException(f"a {mode} worker failed; see {out}/baseline-*.log")
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {r: read_rows(out / f"steps-r{r}.jsonl") for r in range(s.replicas)}


async def _inject(launcher: Launcher, out: Path, s: BenchSettings, kind: str, victim: int) -> float | None:
    """Waits until replica 0 reaches the fault step, then kills or stops the victim."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rows = step_rows(read_rows(out / "steps-r0.jsonl"))
        procs = launcher.replicas[victim].procs
        if rows and rows[-1]["step"] >= s.fault_step and procs:
            pid = procs[0].pid
            await asyncio.sleep(rows[-1]["compute_s"] / 2)  # land inside the next step's compute
            t = time.time()
            if kind == "crash":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(s.hang_s)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            return t
        await asyncio.sleep(0.02)
    return None


def run_unbroken(
    s: BenchSettings, out: Path, fault: str | None, victim: int, mode: str | None = None, model: str = "mlp"
) -> tuple[dict[int, list[Row]], float | None, int]:
    ranks = s.ranks if model == "llama" else 1
    # The Llama's figures are about the injected fault: on a shared 2-core machine the diagnosis
    # otherwise acts on healthy replicas (silence while 6 processes import transformers, the
    # memory growth of the first steps) in the middle of the measurement.
    settings = LaunchSettings(
        command=s.worker(mode or s.api, out, model),
        replicas=s.replicas,
        run_dir=out,
        ranks_per_replica=ranks,
        threads_per_rank=int(_threads(s.replicas * ranks)),
    )
    if model == "llama":
        settings = dataclasses.replace(settings, on_verdict="ignore")

    async def go() -> tuple[int, float | None]:
        launcher = Launcher(settings)
        injector = asyncio.create_task(_inject(launcher, out, s, fault, victim)) if fault else None
        code = await launcher.run()
        fault_t = None
        if injector is not None:
            if not injector.done():
                injector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                fault_t = await injector
        return code, fault_t

    code, fault_t = asyncio.run(go())
    return {r: read_rows(out / f"steps-r{r}.jsonl") for r in range(s.replicas)}, fault_t, code


def paired_ratio(baseline: list[float], ours: list[float]) -> float:
    """The median over rounds of each round's ours / baseline: the two jobs of a round ran
    back to back, so their ratio is free of the drift between rounds that a ratio of the
    medians still carries."""
    if not baseline or len(baseline) != len(ours):
        raise ValueError(f"paired rounds need as many baseline as measured runs, got {len(baseline)} and {len(ours)}")
    return statistics.median(u / b for b, u in zip(baseline, ours, strict=True))


def pair_order(round_index: int) -> tuple[str, str]:
    """Which job of a round runs first: baseline first in even rounds, steady first in odd ones.

    ABBA order: a machine whose speed drifts during the invocation (these shared VMs' does, by
    a third within minutes) then slows the first and the second job of the pairs alike, where
    a fixed order charged the drift to one job.
    """
    return ("baseline", "steady") if round_index % 2 == 0 else ("steady", "baseline")


def run_alternate(s: BenchSettings) -> dict[str, Any]:
    """unbroken's step against plain HSDP inside one job of the example Llama: blocks of
    :data:`~unbroken.bench.training.alternate.ALTERNATE_EVERY` steps of each in turn (its
    ``--plain-alternate``), each unbroken block's median step over the plain blocks around it.
    Two separate jobs on this shared machine differ by more than the few percent to be told apart
    (:mod:`unbroken.bench.training.alternate`). unbroken's background threads (heartbeats, the
    coordinator's connection) run in the plain blocks too: a small cost the figure leaves out."""
    rows, wall = run_llama(_fresh(s.root / "alternate"), s.alternate_steps, "plain", device=s.device, ranks=s.ranks)
    timed = alternating_ratio(rows, ALTERNATE_EVERY, flag="unbroken", spent=None)
    return {
        "overhead_ratio": timed["ratio"],
        "pairs": timed["pairs"],
        "ratios_p10_p90": timed["ratios_p10_p90"],
        "every": ALTERNATE_EVERY,
        "steps": s.alternate_steps,
        "wall_s": round(wall, 1),
    }


def run_all(s: BenchSettings, rounds: int, log: Any, scenarios: tuple[str, ...] = SCENARIOS) -> dict[str, Any]:
    victim = s.replicas - 1
    baseline_medians, steady_medians = [], []
    baseline_cpu, steady_cpu = [], []  # the training thread's CPU per step, where the worker records it
    identical: dict[str, bool] = {}
    result: dict[str, Any] = {"replicas": s.replicas, "params_m": s.params_m, "steps": s.steps}
    if s.model == "mlp":
        result["batch_size"] = s.batch_size
    if s.model != "mlp":
        del result["params_m"]  # the MLP's size; the example Llama has its own (3.9M)
        result |= {"model": s.model, "ranks_per_replica": s.ranks}
    for i in range(rounds if "steady" in scenarios else 0):
        for job in pair_order(i):
            if job == "baseline":
                log(f"round {i + 1}/{rounds}: baseline (plain all-reduce)")
                base = run_baseline(s, _fresh(s.root / f"baseline-{i}"), model=s.model)
                baseline_medians.append(median_step(base))
                if has_field(base, "cpu_s"):
                    baseline_cpu.append(median_step(base, key="cpu_s"))
                continue
            log(f"round {i + 1}/{rounds}: steady (unbroken, no faults)")
            out = _fresh(s.root / f"steady-{i}")
            steady, _, code = run_unbroken(s, out, None, victim, model=s.model)
            if code != 0:
                raise click.ClickException(f"the steady run failed (exit {code}); see {out}/logs")
            steady_medians.append(median_step(steady))
            if has_field(steady, "cpu_s"):
                steady_cpu.append(median_step(steady, key="cpu_s"))
            identical[f"steady-{i}"] = digests_identical(out, s.replicas)
        log(f"  baseline {baseline_medians[-1]:.4f}s  steady {steady_medians[-1]:.4f}s")
    if steady_medians:
        result |= {
            "baseline_step_s": round(statistics.median(baseline_medians), 4),
            "steady_step_s": round(statistics.median(steady_medians), 4),
            "overhead_ratio": round(paired_ratio(baseline_medians, steady_medians), 4),
            "ratio_of_medians": round(statistics.median(steady_medians) / statistics.median(baseline_medians), 4),
            "rounds": [
                {"baseline_step_s": round(b, 4), "steady_step_s": round(u, 4), "ratio": round(u / b, 4)}
                for b, u in zip(baseline_medians, steady_medians, strict=False)
            ],
        }
    if s.alternate_steps:
        log(f"one job of {s.alternate_steps} steps: plain HSDP and unbroken in alternate blocks of {ALTERNATE_EVERY}")
        try:
            result["alternating"] = run_alternate(s)
        except click.ClickException as e:  # the other scenarios' figures still count
            log(f"  the alternating job failed: {e.message}")
            result["alternating"] = {"error": e.message}
    if baseline_cpu and len(baseline_cpu) == len(steady_cpu):
        # The same work on the training thread in both jobs: a ratio near 1 says the gap in step
        # time is waiting (quorum, exchange) and the other threads' and processes' CPU.
        result |= {
            "baseline_train_cpu_s": round(statistics.median(baseline_cpu), 4),
            "steady_train_cpu_s": round(statistics.median(steady_cpu), 4),
            "train_cpu_ratio": round(statistics.median(steady_cpu) / statistics.median(baseline_cpu), 4),
        }
    for fault in [f for f in ("crash", "hang") if f in scenarios]:
        log(f"{fault}: replica {victim} at step {s.fault_step}")
        out = _fresh(s.root / fault)
        rows, fault_t, code = run_unbroken(s, out, fault, victim, model=s.model)
        if fault_t is None or code != 0:
            raise click.ClickException(
                f"the {fault} run failed (exit {code}, fault injected: {fault_t is not None}); see {out}"
            )
        resumed = fault_t + s.hang_s if fault == "hang" else None
        figures = fault_figures(rows, victim, fault_t, resumed).as_json()
        identical[fault] = digests_identical(out, s.replicas)
        result[fault] = {
            **figures,
            "replicas_identical": identical[fault],
            "fault_t": round(fault_t, 3),
            **serving_figures(out, s.replicas, figures["median_step_s"]),
        }
        if fault == "hang":
            result[fault]["stopped_s"] = s.hang_s
        if s.model == "llama":
            result[fault] |= sample_account(rows)
        log(f"  {json.dumps(result[fault])}")
    if "ddp" in scenarios:
        result["ddp"] = {}
        for model in DDP_MODELS:
            result["ddp"][model] = ddp_figures(s, model, rounds, log, identical)
    if "torchft" in scenarios:
        result["torchft"] = torchft_figures(s, rounds, log, identical)
    result["replicas_identical"] = all(identical.values())
    result["identical_by_run"] = identical
    return result


def hidden_share(rows_by_replica: dict[int, list[Row]]) -> dict[str, float]:
    """How much of the DDP wrapper's exchange the backward pass hid, over the steady steps.

    ``busy_s`` is how long the backend was exchanging a step's buckets; ``exchange_s`` the
    part still running when backward ended, which the step waited for.
    """
    rows = [
        r
        for rows in rows_by_replica.values()
        for r in step_rows(rows)
        if r.get("committed") and r["step"] >= WARMUP_STEPS and "busy_s" in r
    ]
    busy = sum(r["busy_s"] for r in rows)
    exposed = sum(min(r["exchange_s"], r["busy_s"]) for r in rows)
    if not rows or busy <= 0:
        return {}
    return {
        "exchange_busy_s": round(busy / len(rows), 4),
        "exchange_exposed_s": round(exposed / len(rows), 4),
        "exchange_hidden_share": round(1.0 - exposed / busy, 4),
    }


def torchft_figures(s: BenchSettings, rounds: int, log: Any, identical: dict[str, bool]) -> dict[str, Any]:
    """The torchft facade's DDP loop against the same loop on unbroken's own DDP wrapper (MLP),
    ``rounds`` pairs in ABBA order: the facade's cost over unbroken's API."""
    own: list[float] = []
    facade: list[float] = []
    for i in range(rounds):
        for job in pair_order(i):
            mode = "ddp" if job == "baseline" else "torchft"
            log(f"round {i + 1}/{rounds}: {'unbroken.DistributedDataParallel' if mode == 'ddp' else 'torchft facade'}")
            out = _fresh(s.root / f"{mode}-api-{i}")
            rows, _, code = run_unbroken(s, out, None, s.replicas - 1, mode=mode)
            if code != 0:
                raise click.ClickException(f"the {mode} run failed (exit {code}); see {out}/logs")
            (own if mode == "ddp" else facade).append(median_step(rows))
            identical[f"{mode}-api-{i}"] = digests_identical(out, s.replicas)
        log(f"  unbroken API {own[-1]:.4f}s  torchft facade {facade[-1]:.4f}s")
    return {
        "unbroken_api_step_s": round(statistics.median(own), 4),
        "torchft_facade_step_s": round(statistics.median(facade), 4),
        "overhead_ratio": round(paired_ratio(own, facade), 4),
        "rounds": [
            {"unbroken_api_step_s": round(a, 4), "torchft_facade_step_s": round(b, 4)}
            for a, b in zip(own, facade, strict=True)
        ],
    }


def ddp_figures(s: BenchSettings, model: str, rounds: int, log: Any, identical: dict[str, bool]) -> dict[str, Any]:
    """unbroken's DDP wrapper against torch's DDP on ``model``, ``rounds`` pairs in ABBA order."""
    torch_medians, ours_medians, shares = [], [], []
    for i in range(rounds):
        for job in pair_order(i):
            if job == "baseline":
                log(f"round {i + 1}/{rounds}: torch DDP ({model})")
                base = run_baseline(s, _fresh(s.root / f"torch-ddp-{model}-{i}"), mode="torch_ddp", model=model)
                torch_medians.append(median_step(base))
                continue
            log(f"round {i + 1}/{rounds}: unbroken DistributedDataParallel ({model})")
            out = _fresh(s.root / f"ddp-{model}-{i}")
            ours, _, code = run_unbroken(s, out, None, s.replicas - 1, mode="ddp", model=model)
            if code != 0:
                raise click.ClickException(f"the DDP run failed (exit {code}); see {out}/logs")
            ours_medians.append(median_step(ours))
            shares.append(hidden_share(ours))
            identical[f"ddp-{model}-{i}"] = digests_identical(out, s.replicas)
        log(f"  torch DDP {torch_medians[-1]:.4f}s  unbroken DDP {ours_medians[-1]:.4f}s  {shares[-1]}")
    t, u = statistics.median(torch_medians), statistics.median(ours_medians)
    hidden = [x["exchange_hidden_share"] for x in shares if x]
    return {
        "torch_ddp_step_s": round(t, 4),
        "unbroken_ddp_step_s": round(u, 4),
        "overhead_ratio": round(paired_ratio(torch_medians, ours_medians), 4),
        "ratio_of_medians": round(u / t, 4),
        "exchange_hidden_share": round(statistics.median(hidden), 4) if hidden else None,
        "rounds": [
            {"torch_ddp_step_s": round(a, 4), "unbroken_ddp_step_s": round(b, 4), "ratio": round(b / a, 4), **x}
            for a, b, x in zip(torch_medians, ours_medians, shares, strict=False)
        ],
    }


@click.command()
@click.option("--params-m", type=float, default=25.0, show_default=True, help="MLP size in millions of parameters.")
@click.option("--replicas", type=click.IntRange(2, 3), default=3, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(20),
    default=None,
    help="Steps of each job [default: 60; 400 for --model llama --device cuda, whose 50 ms steps "
    "would end a 60-step job before a restarted replica (CUDA init) is back].",
)
@click.option("--fault-step", type=click.IntRange(WARMUP_STEPS + 5), default=20, show_default=True)
@click.option(
    "--hang-s",
    type=click.FloatRange(0.5, 60),
    default=4.0,
    show_default=True,
    help="How long the hung replica stays stopped before SIGCONT.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1, 10),
    default=2,
    show_default=True,
    help="Baseline/steady pairs for the overhead ratio, in ABBA order (an even number cancels a steady drift).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 4096),
    default=32,
    show_default=True,
    help="MLP samples per replica and step: more compute per step at the same exchange, to tell a fixed "
    "per-step cost from one that grows with the step.",
)
@click.option(
    "--only",
    "only",
    multiple=True,
    type=click.Choice(SCENARIOS),
    help="Run only these scenarios (repeatable); default all.",
)
@click.option(
    "--api",
    type=click.Choice(["optimizer", "ddp"]),
    default="optimizer",
    show_default=True,
    help="What steady, crash and hang train with: unbroken.Optimizer (averages in step()) or "
    "unbroken.DistributedDataParallel (averages during backward).",
)
@click.option(
    "--model",
    type=click.Choice(["mlp", "llama"]),
    default="mlp",
    show_default=True,
    help="What steady, crash and hang train: the MLP, or the example Llama (FSDP2 per replica; needs "
    "the examples extra).",
)
@click.option(
    "--ranks-per-replica",
    type=click.IntRange(1, 8),
    default=None,
    help="Ranks per replica (FSDP2 shards over them); --model llama only, default 2.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the llama trains (--model llama): cuda runs one rank per replica by default, the replicas "
    "sharing the machine's GPUs (auto: Gloo across replicas on a shared GPU, NCCL otherwise).",
)
@click.option(
    "--alternate-steps",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="--model llama: also one job of this many steps alternating plain HSDP and unbroken's "
    f"step in blocks of {ALTERNATE_EVERY}, timing unbroken's cost inside one job (0: none; without "
    "--only, only that job runs).",
)
@click.option("--work-dir", type=click.Path(path_type=Path), default=Path("runs/bench/recovery"), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/recovery.json"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def recovery(
    params_m: float,
    replicas: int,
    steps: int | None,
    fault_step: int,
    hang_s: float,
    rounds: int,
    batch_size: int,
    only: tuple[str, ...],
    api: str,
    model: str,
    ranks_per_replica: int | None,
    device: str,
    alternate_steps: int,
    work_dir: Path,
    out: Path,
    as_json: bool,
) -> None:
    """Crash and hang recovery, catch-up and no-fault overhead against a plain all-reduce."""
    if alternate_steps:
        if model != "llama":
            raise click.BadParameter("times the example Llama: add --model llama", param_hint="--alternate-steps")
        if alternate_steps < 4 * ALTERNATE_EVERY:
            raise click.BadParameter(
                f"must be 0 or at least {4 * ALTERNATE_EVERY} steps (two plain/unbroken pairs after the first)",
                param_hint="--alternate-steps",
            )
    if params_m <= 0:
        raise click.BadParameter("must be > 0", param_hint="--params-m")
    if model == "mlp" and ranks_per_replica not in (None, 1):
        raise click.BadParameter(
            "the MLP scenarios run one rank per replica; use --model llama", param_hint="--ranks-per-replica"
        )
    if device == "cuda" and model != "llama":
        raise click.BadParameter("--device cuda trains the example Llama: add --model llama", param_hint="--device")
    if model == "llama":
        if api == "ddp" or "ddp" in only:
            raise click.BadParameter(
                "--model llama averages in FSDP2's hook, not with the DDP wrapper", param_hint="--api"
            )
        only = only or (() if alternate_steps else ("steady", "crash", "hang"))
    if steps is None:
        steps = 400 if model == "llama" and device == "cuda" else 60
    if fault_step >= steps - 10:
        raise click.BadParameter(
            f"must leave at least 10 steps after the fault (< {steps - 10})", param_hint="--fault-step"
        )
    s = BenchSettings(
        replicas,
        params_m,
        steps,
        fault_step,
        hang_s,
        work_dir,
        api="ddp" if api == "ddp" else "unbroken",
        model=model,
        ranks=ranks_per_replica or (2 if model == "llama" and device == "cpu" else 1),
        device=device,
        batch_size=batch_size,
        alternate_steps=alternate_steps,
    )

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    t0 = time.time()
    result = run_all(s, rounds, log, only if only or alternate_steps else SCENARIOS)
    result["wall_s"] = round(time.time() - t0, 1)
    publish(result, out, as_json)
    if not as_json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="unbroken bench recovery")
        table.add_column("figure")
        table.add_column("value")
        for key in ("baseline_step_s", "steady_step_s", "overhead_ratio", "ratio_of_medians", "train_cpu_ratio"):
            if key in result:
                table.add_row(key, str(result[key]))
        for fault in [f for f in ("crash", "hang") if f in result]:
            for key, value in result[fault].items():
                table.add_row(f"{fault}.{key}", str(value))
        for model, figures in result.get("ddp", {}).items():
            for key in (
                "torch_ddp_step_s",
                "unbroken_ddp_step_s",
                "overhead_ratio",
                "ratio_of_medians",
                "exchange_hidden_share",
            ):
                table.add_row(f"ddp.{model}.{key}", str(figures[key]))
        table.add_row("replicas_identical", str(result["replicas_identical"]))
        Console().print(table)
