"""``unbroken bench diagnosis``: does diagnosis name the right culprit and class, and how fast?

Every scenario is a real job: 3 replicas of the example GPT (``unbroken.examples.gpt.train``) under
``unbroken run``'s launcher with the coordinator's diagnosis master, one fault each from the
chaos schedules (``crash``, ``hang``, ``slow_rank``, ``nan_loss``) or the ring transport's link
faults (``UNBROKEN_LINK_FAULT``, with ``UNBROKEN_EXCHANGE=ring``). The supervisor is told to
ignore verdicts (``on_verdict=ignore``) so that the first verdict is judged on a job that the
verdict itself has not changed; a run stops a few seconds after its fault is diagnosed.

Clean runs (one of them with a CPU hog that this benchmark starts and stops) count false
positives: any verdict there is one. The recorder's overhead alternates runs with the recorder
on and off (``UNBROKEN_RECORDER=0``) and compares their median step times pair by pair; the
recorder's own cost per step on each thread is also timed in process, since on a shared 2-core
machine the job-level ratio carries a few percent of noise.

Scoring is the pure :func:`score` over the run's events and per-step metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import unittest.mock
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from unbroken.bench.network.diagnosis_rates import CLEAN_CLASS, calibrate, run_scores, summarize, variant
from unbroken.bench.output import publish
from unbroken.bench.training.alternate import ALTERNATE_EVERY, alternating_ratio, run_llama, run_mlp
from unbroken.comm.recorder import FlightRecorder
from unbroken.config import ENV_EXCHANGE, ENV_LINK_FAULT, ENV_RECORDER
from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.master.master_state import MasterSettings
from unbroken.diagnosis.rules.calibrate import describe
from unbroken.diagnosis.rules.links import ONE_WAY_FACTOR
from unbroken.diagnosis.verdict import COMM_HANG, COMM_SLOW, METRIC_ANOMALY, NONCOMM_HANG, STRAGGLER
from unbroken.faults.schedule import Schedule
from unbroken.launch.run.launcher import Launcher, LaunchSettings
from unbroken.observe.events import read_events, read_jsonl

Row = dict[str, Any]
TRAIN_MODULE = "unbroken.examples.gpt.train"
REPLICAS = 3
ONSET = 40  # faults start here: past warm-up and the first straggler window
CRASH = "crash"  # not a diagnosis class: a crash is seen by the supervisor as a process exit


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One job and what diagnosis should say about it.

    Attributes:
        faults: ``--fault`` flags of the chaos schedule.
        env: extra worker environment (exchange mode, link fault).
        expect: the classes accepted as right (empty: a clean run, where any verdict is false).
        culprit: the guilty replica, or the guilty link's two replicas.
        onset_step: the step a link fault starts at (chaos faults carry their own onset event).
        hog: run a CPU hog through the middle of the job.
        seed: the training script's seed (``--runs`` varies it).
    """

    name: str
    kind: str
    steps: int
    faults: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    expect: frozenset[str] = frozenset()
    culprit: int | tuple[int, int] | None = None
    onset_step: int | None = None
    pace_s: float = 0.0
    hog: bool = False
    seed: int = 0

    @property
    def clean(self) -> bool:
        return not self.expect


def _ring(fault: str | None = None) -> tuple[tuple[str, str], ...]:
    return ((ENV_EXCHANGE, "ring"),) + (((ENV_LINK_FAULT, fault),) if fault else ())


AFTER = ONSET + 60  # a fault run's last step; it usually stops well before, at its verdict
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("crash", "crash", AFTER, (f"crash:replica=1,step={ONSET}",), expect=frozenset({CRASH}), culprit=1),
    Scenario(
        "hang_noncomm", "hang", AFTER, (f"hang:replica=2,step={ONSET}",), expect=frozenset({NONCOMM_HANG}), culprit=2
    ),
    Scenario(
        "hang_comm",
        "link_stall",
        AFTER,
        env=_ring(f"0-1:stall:step={ONSET}"),
        expect=frozenset({COMM_HANG}),
        culprit=(0, 1),
        onset_step=ONSET,
    ),
    Scenario(
        "straggler_1.5x",
        "slow_rank",
        AFTER,
        (f"slow_rank:replica=0,factor=1.5,step={ONSET}",),
        expect=frozenset({STRAGGLER}),
        culprit=0,
    ),
    Scenario(
        "straggler_3x",
        "slow_rank",
        AFTER,
        (f"slow_rank:replica=1,factor=3,step={ONSET}",),
        expect=frozenset({STRAGGLER}),
        culprit=1,
    ),
    Scenario(
        "slow_link",
        "link_slow",
        AFTER,
        env=_ring(f"0-2:mb_s=60:step={ONSET}"),
        expect=frozenset({COMM_SLOW}),
        culprit=(0, 2),
        onset_step=ONSET,
    ),
    Scenario(
        "slow_node",
        "node_slow",
        AFTER,
        env=_ring(f"2:mb_s=60:step={ONSET}"),
        expect=frozenset({COMM_SLOW}),
        culprit=2,
        onset_step=ONSET,
    ),
    Scenario(
        "nan_loss",
        "nan_loss",
        AFTER,
        (f"nan_loss:replica=1,step={ONSET}",),
        expect=frozenset({METRIC_ANOMALY}),
        culprit=1,
    ),
    # One replica 1.3x slower: under the straggler threshold (1.39x), a step-time change point.
    Scenario(
        "throughput_drop",
        "slow_rank",
        AFTER,
        (f"slow_rank:replica=2,factor=1.3,step={ONSET}",),
        expect=frozenset({METRIC_ANOMALY, STRAGGLER}),
        culprit=2,
    ),
    Scenario("clean", "clean", 400),
    Scenario("clean_busy", "clean", 400, hog=True),
    Scenario("clean_ring", "clean", 300, env=_ring()),
)


# -- pure scoring ----------------------------------------------------------------------------


def _matches(culprit: dict[str, Any], want: int | tuple[int, int] | None) -> bool:
    if isinstance(want, tuple):
        link = culprit.get("link")
        return link is not None and set(link) == set(want)
    return culprit.get("replica") == want


def onset_time(sc: Scenario, events: Sequence[Row], rows: Sequence[Row]) -> float | None:
    """When the fault began: its ``fault_injected`` event, or for a link fault the end of the
    step it starts after (the transport applies it from the next exchange on)."""
    if sc.onset_step is not None:
        ts = [r["t"] for r in rows if r.get("step") == sc.onset_step and r.get("committed")]
        return min(ts) if ts else None
    ts = [e["t"] for e in events if e["kind"] == "fault_injected"]
    return min(ts) if ts else None


def _detection(sc: Scenario, e: Row) -> tuple[str, dict[str, Any]] | None:
    """(class, culprit) if ``e`` is a detection event of this scenario's kind."""
    if e["kind"] == "verdict":
        return e.get("class", ""), e.get("culprit") or {}
    if CRASH in sc.expect and e["kind"] == "process_exited":
        return CRASH, {"replica": e.get("replica"), "rank": e.get("rank")}
    return None


def score(sc: Scenario, events: Sequence[Row], rows: Sequence[Row]) -> Row:
    """One scenario's line: detected, right culprit and class, detection time, false positives.

    The first detection after onset is judged. Verdicts before onset (or any in a clean run)
    are false positives.
    """
    onset = None if sc.clean else onset_time(sc, events, rows)
    found = [(e["t"], d) for e in sorted(events, key=lambda e: e["t"]) if (d := _detection(sc, e)) is not None]
    before = [d for t, d in found if onset is None or t < onset]
    after = [(t, d) for t, d in found if onset is not None and t >= onset]
    out: Row = {
        "name": sc.name,
        "kind": sc.kind,
        "clean": sc.clean,
        "detected": None,
        "culprit_correct": None,
        "class_correct": None,
        "detect_s": None,
        "detect_steps": None,
        "false_positives": len(before),
        "steps": max((r["step"] for r in rows), default=-1) + 1,
        "span_s": round(max(ts) - min(ts), 3) if (ts := [r["t"] for r in rows if r.get("committed")]) else 0.0,
    }
    if before:
        out["false_verdicts"] = [{"class": c, "culprit": p} for c, p in before[:5]]
    if sc.clean:
        return out
    out["detected"] = bool(after)
    if onset is None:
        out["note"] = "the fault never started (the job ended first)"
        return out
    if after:
        t, (cls, culprit) = after[0]
        out.update(
            culprit_correct=_matches(culprit, sc.culprit),
            class_correct=cls in sc.expect,
            detect_s=round(t - onset, 3),
            verdict={"class": cls, "culprit": culprit},
            detect_steps=len({r["step"] for r in rows if onset < r["t"] <= t}),
        )
    return out


def median_step_s(rows: Sequence[Row], skip: int = 10) -> float | None:
    xs = [r["step_s"] for r in rows if r.get("committed") and r["step"] >= skip]
    return statistics.median(xs) if xs else None


# -- running ---------------------------------------------------------------------------------


def _environ(extra: dict[str, str]) -> contextlib.AbstractContextManager[Any]:
    """Workers inherit the launcher's environment; set the scenario's part for one run."""
    return unittest.mock.patch.dict(os.environ, extra)


def _rows(run_dir: Path) -> list[Row]:
    return [row for r in range(REPLICAS) for row in read_jsonl(run_dir / f"metrics-r{r}.jsonl")]


HOGS = 2  # busy-loop processes of a loaded run: one per core of the 2-core machine the bench ran on


def start_hogs(n: int = HOGS) -> list[subprocess.Popen[bytes]]:
    """``n`` busy-loop processes on the same cores as the job (a shared node's other tenants)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def stop_hogs(hogs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Ends the hogs this benchmark started, each by its own pid."""
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
            hog.wait()


async def _watch(launcher: Launcher, sc: Scenario, run_dir: Path, grace_s: float, limit_s: float) -> None:
    """Stops a fault run ``grace_s`` after its first detection (or at ``limit_s``); starts and
    stops the CPU hogs of a loaded run (through the middle half of its steps)."""
    t0 = time.monotonic()
    hogs: list[subprocess.Popen[bytes]] = []
    hogged = False
    try:
        while True:
            await asyncio.sleep(0.5)
            if sc.hog and not hogged and launcher.job_step >= sc.steps // 4:
                hogs, hogged = start_hogs(), True
            if hogs and launcher.job_step >= 3 * sc.steps // 4:
                stop_hogs(hogs)
                hogs = []
            if time.monotonic() - t0 > limit_s:
                break
            if sc.clean:
                continue
            events = list(read_events(run_dir / "events.jsonl"))
            onset = onset_time(sc, events, _rows(run_dir)) if sc.onset_step is not None else None
            hit = any(
                _detection(sc, e)
                for e in events
                if e["kind"] in ("verdict", "process_exited")
                and (sc.onset_step is None or (onset is not None and e["t"] >= onset))
            )
            if hit:
                await asyncio.sleep(grace_s)
                break
        launcher.stop()
    finally:
        stop_hogs(hogs)


async def _run(
    sc: Scenario,
    run_dir: Path,
    recorder: bool = True,
    limit_s: float = 240.0,
    scores: list[Any] | None = None,
    grace_s: float = 2.0,
) -> tuple[list[Row], list[Row]]:
    settings = LaunchSettings(
        command=(
            sys.executable,
            "-m",
            TRAIN_MODULE,
            "--steps",
            str(sc.steps),
            "--pace-s",
            str(sc.pace_s),
            "--seed",
            str(sc.seed),
        ),
        replicas=REPLICAS,
        run_dir=run_dir,
        schedule=Schedule.build(flags=sc.faults),
        on_verdict="ignore",
        on_hang="wait",
        max_restarts=2,
        warm_spare=False,
        heartbeat_timeout_s=2.0,
    )
    launcher = Launcher(settings)
    watcher = asyncio.create_task(_watch(launcher, sc, run_dir, grace_s=grace_s, limit_s=limit_s))
    log = scores if scores is not None else []
    # The master's rule scores at each new collective (the coordinator runs in this process).
    on_scores = staticmethod(lambda s: log.append({rule: dict(v) for rule, v in s.items()}))
    try:
        with unittest.mock.patch.object(DiagnosisMaster, "on_scores", on_scores):
            await launcher.run()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return list(read_events(run_dir / "events.jsonl")), _rows(run_dir)


def run_scenario(sc: Scenario, root: Path, run: int | None = None, grace_s: float = 2.0) -> Row:
    """Runs and scores one job; ``run``: its index under ``--runs`` (its own directory);
    ``grace_s``: how long a fault run goes on after its first detection (its scores keep coming)."""
    run_dir = root / (sc.name if run is None else f"{sc.name}-{run}")
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    load = os.getloadavg()[0]
    env = {ENV_RECORDER: "1", **dict(sc.env)}
    if ENV_EXCHANGE not in dict(sc.env):
        env[ENV_EXCHANGE] = "backend"  # whatever this shell says
    log: list[Any] = []
    with _environ(env):
        events, rows = asyncio.run(_run(sc, run_dir, scores=log, grace_s=grace_s))
    out = score(sc, events, rows)
    settings = MasterSettings()
    confirm = {
        "step_time": settings.confirm,
        "straggler": settings.straggler_confirm,
        "link": settings.link_confirm,
        "link_one_way": settings.link_confirm,
    }
    out["scores"] = run_scores(sc.name, sc.clean, sc.culprit, log, confirm)
    (run_dir / "scores.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    out.update(
        {
            "class": CLEAN_CLASS if sc.clean else sc.name,
            "run": run,
            "seed": sc.seed,
            "exchange": dict(sc.env).get(ENV_EXCHANGE) or "backend",
            "hog": sc.hog,
            "pace_s": sc.pace_s,
            "loadavg_1m_at_start": round(load, 2),
            "wall_s": round(time.time() - t0, 1),
            "median_step_s": median_step_s(rows),
        }
    )
    return out


def paired_ratio(pairs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float | None:
    """Median over pairs of (median step with the recorder / median step without).

    Each pair ran back to back, so load from other work on a shared machine, which drifts over
    minutes, cancels within a pair; pooling all runs would mix it into the ratio.
    """
    ratios = [statistics.median(on) / statistics.median(off) for on, off in pairs if on and off]
    return statistics.median(ratios) if ratios else None


def record_overhead(root: Path, rounds: int, steps: int) -> Row:
    """Step time with the recorder over without, from alternating clean runs."""
    pairs: list[tuple[list[float], list[float]]] = []
    for i in range(rounds):
        got: dict[str, list[float]] = {}
        for flag in ("1", "0") if i % 2 == 0 else ("0", "1"):
            run_dir = root / f"overhead-{i}-{flag}"
            shutil.rmtree(run_dir, ignore_errors=True)
            with _environ({ENV_RECORDER: flag}):
                _, rows = asyncio.run(_run(Scenario("overhead", "clean", steps), run_dir))
            got[flag] = [r["step_s"] for r in rows if r.get("committed") and r["step"] >= 10]
        pairs.append((got["1"], got["0"]))
    on = [x for p, _ in pairs for x in p]
    off = [x for _, p in pairs for x in p]
    ratio = paired_ratio(pairs)
    direct = recorder_cost_us()
    return {
        "record_overhead_ratio": round(ratio, 4) if ratio else None,
        "record_overhead_ratio_pooled": round(statistics.median(on) / statistics.median(off), 4)
        if on and off
        else None,
        "record_overhead_pair_ratios": [
            round(statistics.median(a) / statistics.median(b), 4) for a, b in pairs if a and b
        ],
        "median_step_s_recorder_on": statistics.median(on) if on else None,
        "median_step_s_recorder_off": statistics.median(off) if off else None,
        "overhead_steps_each": [len(on), len(off)],
        "recorder_us_per_step": direct,
        "recorder_direct_ratio": round(1 + direct["training_thread"] * 1e-6 / statistics.median(off), 6)
        if off
        else None,
    }


def recorder_cost_us(n: int = 5000) -> dict[str, float]:
    """What the recorder costs the threads it runs on, per step, in microseconds (in process).

    ``training_thread``: a collective's begin/end and the step's metrics; ``ring_transfers``: the
    hooks of one 3-member ring all-reduce (8 transfers, on the exchange's thread); ``batch``:
    one shipment on the connection thread (10 per second).
    """
    rec = FlightRecorder(0)
    members = [0, 1, 2]
    t0 = time.perf_counter()
    for i in range(n):
        r = rec.begin("bench/epoch1", "allreduce", 1 << 20, members)
        rec.end(r, True)
        rec.record_step(i, 2.0, 1.0, None)
    train = (time.perf_counter() - t0) / n
    rec.open = rec.begin("bench/epoch1", "allreduce", 1 << 20, members)
    t0 = time.perf_counter()
    for _ in range(n):
        for step in range(4):
            a, b = rec.posted("recv", 1, step, 1 << 18), rec.posted("send", 2, step, 1 << 18)
            rec.done("recv", 1, step, a)
            rec.done("send", 2, step, b)
    ring = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n // 10):
        rec.batch()
    ship = (time.perf_counter() - t0) / (n // 10)
    return {
        "training_thread": round(train * 1e6, 2),
        "ring_transfers": round(ring * 1e6, 2),
        "batch": round(ship * 1e6, 2),
    }


def plan(only: Sequence[str], runs: int) -> list[tuple[Scenario, int | None]]:
    """The jobs to run: each chosen scenario once as written (``runs`` 0), or ``runs`` variants
    of each chosen fault scenario and of ``clean`` (which covers the ring, the backend and the
    CPU hog among its variants; the other clean scenarios are its fixed cases)."""
    chosen = [s for s in SCENARIOS if not only or s.name in only]
    if runs == 0:
        return [(s, None) for s in chosen]
    base = [s for s in chosen if not s.clean or s.name == "clean"]
    if only and not base:  # only fixed clean cases asked for: vary the first one
        base = chosen[:1]
    return [(variant(s, i), i) for i in range(runs) for s in base]


@click.command()
@click.option(
    "--only",
    "only",
    multiple=True,
    metavar="NAME",
    help=f"Run only this scenario (repeatable): {', '.join(s.name for s in SCENARIOS)}.",
)
@click.option(
    "--runs",
    type=int,
    default=0,
    show_default=True,
    help="Run each fault kind and the clean run this many times (seeds, loads, step times, exchanges "
    "varied) and report rates per class; 0: each scenario once as written.",
)
@click.option(
    "--overhead-rounds",
    type=int,
    default=3,
    show_default=True,
    help="Recorder on/off pairs for record_overhead_ratio (0: skip).",
)
@click.option("--overhead-steps", type=int, default=120, show_default=True)
@click.option(
    "--llama-recorder-steps",
    type=int,
    default=0,
    show_default=True,
    help="Steps of an example Llama job (3 x 2 FSDP2 ranks) that times the recorder off and on in "
    f"alternate blocks of {ALTERNATE_EVERY} steps (0: none; needs the examples extra).",
)
@click.option(
    "--mlp-recorder-steps",
    type=int,
    default=0,
    show_default=True,
    help="Steps of a job of bench recovery's MLP (3 replicas, 3M parameters) that times the recorder "
    f"off and on in alternate blocks of {ALTERNATE_EVERY} steps (0: none).",
)
@click.option(
    "--grace-s",
    type=float,
    default=2.0,
    show_default=True,
    help="Seconds a fault run goes on after its first detection: longer gives the calibration the "
    "fault's steady scores.",
)
@click.option(
    "--run-dir", type=click.Path(path_type=Path), default=Path("runs/bench/diagnosis-runs"), show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/diagnosis.json"), show_default=True)
def diagnosis(
    only: tuple[str, ...],
    runs: int,
    overhead_rounds: int,
    overhead_steps: int,
    llama_recorder_steps: int,
    mlp_recorder_steps: int,
    grace_s: float,
    run_dir: Path,
    as_json: bool,
    out: Path,
) -> None:
    """Inject each fault into a real 3-replica job and score diagnosis's verdicts."""
    names = {s.name for s in SCENARIOS}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise click.UsageError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(sorted(names))}")
    if overhead_rounds < 0 or overhead_steps < 20 or runs < 0:
        raise click.UsageError("--overhead-rounds and --runs must be >= 0 and --overhead-steps >= 20")
    for name, value in (("--llama-recorder-steps", llama_recorder_steps), ("--mlp-recorder-steps", mlp_recorder_steps)):
        if value and value < 4 * ALTERNATE_EVERY:
            raise click.UsageError(f"{name} must be 0 or at least {4 * ALTERNATE_EVERY}, got {value}")
    result: Row = {"record_overhead_ratio": None, "runs": runs, "loadavg_at_start": list(os.getloadavg())}
    if overhead_rounds and not only:
        click.echo(f"recorder overhead: {overhead_rounds} on/off pairs of {overhead_steps} steps ...", err=True)
        result.update(record_overhead(run_dir, overhead_rounds, overhead_steps))
    for model, steps in (("llama", llama_recorder_steps), ("mlp", mlp_recorder_steps)):
        if not steps:
            continue
        click.echo(f"recorder on the {model}: {steps} steps in alternate blocks ...", err=True)
        job_dir = run_dir / f"{model}-recorder"
        shutil.rmtree(job_dir, ignore_errors=True)
        job_rows, wall = run_llama(job_dir, steps, "recorder") if model == "llama" else run_mlp(job_dir, steps)
        timed = alternating_ratio(job_rows, ALTERNATE_EVERY, flag="recorded", spent=None)
        result[f"{model}_record_overhead_ratio"] = timed["ratio"]
        result[f"{model}_recorder"] = {k: v for k, v in timed.items() if k != "own_share"} | {
            "steps": steps,
            "every": ALTERNATE_EVERY,
            "wall_s": round(wall, 1),
        }
    rows: list[Row] = []
    for sc, i in plan(only, runs):
        click.echo(f"scenario {sc.name}{'' if i is None else f' run {i}'} ...", err=True)
        row = run_scenario(sc, run_dir, i, grace_s)
        click.echo(f"  {json.dumps({k: v for k, v in row.items() if k != 'scores'})}", err=True)
        rows.append(row)
    s = MasterSettings()
    result["calibration"] = calibrate(
        rows,
        {
            "step_time": s.step_time_threshold,
            "straggler": 1 / s.straggler_threshold,
            "link": s.link_ratio,
            "link_one_way": ONE_WAY_FACTOR * s.link_ratio,
        },
    )
    for row in rows:  # thousands of held scores per run: the calibration above summarizes them
        row["scores"] = {rule: {side: describe(xs) for side, xs in got.items()} for rule, got in row["scores"].items()}
    result["scenarios"] = rows
    result.update(summarize(rows))
    result["loadavg_at_end"] = list(os.getloadavg())
    result["clean_steps"] = sum(r["steps"] for r in rows if r["clean"])
    result["false_positives"] = sum(r["false_positives"] for r in rows)
    faulty = [r for r in rows if not r["clean"]]
    result["all_correct"] = all(r["detected"] and r["culprit_correct"] and r["class_correct"] for r in faulty)
    publish(result, out, as_json)
    if not as_json:
        click.echo(
            f"{'class':>16} {'runs':>4} {'detected':>8} {'right':>5} {'wrong':>5} {'false':>5} "
            f"{'false/h':>7} {'verdict_s p50':>13} {'p90':>6}"
        )
        for c in result["classes"]:
            click.echo(
                f"{c['class']:>16} {c['runs']:>4} {c['detected']:>8} {c['named_right']:>5} "
                f"{c['wrong_culprit'] + c['wrong_class']:>5} {c['false_verdicts']:>5} "
                f"{c['false_verdicts_per_clean_hour'] if c['false_verdicts_per_clean_hour'] is not None else '-':>7} "
                f"{c['verdict_s_p50'] if c['verdict_s_p50'] is not None else '-':>13} "
                f"{c['verdict_s_p90'] if c['verdict_s_p90'] is not None else '-':>6}"
            )
        click.echo(
            f"precision={result['precision']} recall={result['recall']} "
            f"record_overhead_ratio={result['record_overhead_ratio']} loadavg={result['loadavg_at_end']}"
        )
