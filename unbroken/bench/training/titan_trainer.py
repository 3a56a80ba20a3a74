"""``unbroken bench torchtitan``: torchtitan's fault-tolerant trainer on unbroken and on torchft.

The same job on both, started the same way each time: torchtitan 0.3.0's own entry point
(``torchtitan.train.main``, ``FaultTolerantTrainer``, llama3 debug model, per-step HSDP over
Gloo, ``--checkpoint.enable``) in 3 replica groups of 1 rank, behind the CPU stand-ins of
:mod:`unbroken.bench.training.titan_standins`. When group 1 logs step 5 it is ``kill -9``-ed (``--fault
kill``) or ``SIGSTOP``-ped (``--fault stop``, ``SIGCONT``-ed ``--stop-s`` later if still there).

- **unbroken**: ``unbroken run --torchft-compat --replicas 3 --min-replicas 1``: torchtitan's
  ``import torchft`` is the facade; the launcher restarts a dead group, the coordinator routes
  around a stopped one and the supervisor restarts it. With ``--hot-spares K``, K more groups
  start with the job and wait, model built, for a lost group's place (its restart then waits in
  its turn); torchtitan's ``group_size`` counts them, so its data is cut in 3 + K shards.
- **torchft**: torchft-nightly itself, launched as its users do: ``torchft_lighthouse
  --min_replicas 1 --join_timeout_ms 10000`` and one process per group with ``TORCHFT_LIGHTHOUSE``
  and ``REPLICA_GROUP_ID``. This harness restarts a group whose process exited non-zero, as
  ``torchrun --max-restarts`` would (the stand-in for torchelastic: one rank per group), and
  gives each the torch threads ``unbroken run`` gives a worker (the cores split evenly).

Per start, from the groups' own log lines (``step: N`` with torchtitan's timestamps):

- ``crashed``: a process exited with an error that was not the injected fault;
- ``hung``: the job had not ended after ``--timeout-s``;
- ``replicas_identical``: every group ended and their final models are bitwise equal;
- ``survivor_stall_s``: per surviving group, the time its steps lost after the fault (each gap
  over twice the steady step, less one step), the worst group;
- ``full_strength_s``: from the fault to the first step of the group in the faulted one's place
  (itself restarted, or a hot spare) back in line with the survivors (within one step of them);
- ``step_s``: the median step of group 0 before the fault;
- ``restart_phases_s``: the faulted group's restarted process, from the fault: its first log
  line (``imported``: the supervisor's decision, the process start, torchtitan's imports),
  ``Training starts`` (``initialized``: model, optimizer, checkpointer, the fault-tolerance
  manager and its connections) and its first step (``first_step``: the quorum, the catch-up, a
  step; none while it waits as a hot spare).

The figures per system are the medians over starts (counts for crashes, hangs and identical
ends). Needs ``make torchft-upstream``: both wheels unpacked into ``.cache/upstream`` and the
``[torchft]`` extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
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
from unbroken.config import python_path
from unbroken.launch.workers import free_port
from unbroken.observe.events import read_jsonl

SYSTEMS = ("unbroken", "torchft")
FAULTS = ("kill", "stop")
REPLICAS = 3
VICTIM = 1
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?\bstep:\s+(\d+)\s", re.M)
ANY_LINE = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$", re.M)
LIGHTHOUSE = "from torchft._torchft import lighthouse_main\nlighthouse_main()\n"


# -- the figures, from log text (pure) ----------------------------------------------------------


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def restart_phases(text: str, fault_t: float) -> dict[str, float]:
    """The phases of the faulted group's restart (see the module's ``restart_phases_s``), in
    seconds from the fault, read from its log; a phase not reached is left out."""
    out: dict[str, float] = {}
    for stamp, rest in ANY_LINE.findall(ANSI.sub("", text)):
        t = _stamp(stamp) - fault_t
        if t <= 0:
            continue
        out.setdefault("imported", round(t, 3))
        if "Training starts at step" in rest:
            out.setdefault("initialized", round(t, 3))
        if re.search(r"\bstep:\s+\d+\s", rest) and "initialized" in out:
            out.setdefault("first_step", round(t, 3))
    return out


def step_times(text: str) -> list[tuple[float, int]]:
    """``(wall time, step)`` of every ``step: N`` line torchtitan logged, in order."""
    out = []
    for stamp, step in STEP_LINE.findall(ANSI.sub("", text)):
        out.append((_stamp(stamp), int(step)))
    return out


def steady_step_s(times: list[tuple[float, int]], fault_t: float, skip: int = 2) -> float | None:
    """The median gap between consecutive steps before the fault, past the first ``skip``."""
    before = [t for t, _ in times if t < fault_t][skip:]
    gaps = [b - a for a, b in zip(before, before[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def stall_s(times: list[tuple[float, int]], fault_t: float, step_s: float) -> float:
    """Time a survivor's steps lost after the fault: each gap ending after it that is over twice
    the steady step counts, less the one step it would have taken anyway."""
    ts = [t for t, _ in times]
    return sum(b - a - step_s for a, b in zip(ts, ts[1:], strict=False) if b > fault_t and b - a > 2 * step_s)


def full_strength_s(
    victim: list[tuple[float, int]], survivors: list[list[tuple[float, int]]], fault_t: float
) -> float | None:
    """From the fault to the victim's first step within one of the survivors' latest at that time."""
    for t, step in victim:
        if t <= fault_t:
            continue
        latest = max((s for times in survivors for ts, s in times if ts <= t), default=0)
        if step >= latest - 1:
            return t - fault_t
    return None


@dataclasses.dataclass
class Start:
    """One start of the job on one system."""

    system: str
    fault: str
    crashed: bool = False
    hung: bool = False
    replicas_identical: bool = False
    survivor_stall_s: float | None = None
    full_strength_s: float | None = None
    step_s: float | None = None
    restart_phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)


def judge(start: Start, logs: dict[int, str], fault_t: float | None) -> Start:
    """Fills ``start``'s timings from each group's log text (groups 0..REPLICAS-1 but the
    victim survive; any other group, the victim's restart or a hot spare, may take its place)."""
    times = {r: step_times(text) for r, text in logs.items()}
    if fault_t is None:
        return start
    start.step_s = steady_step_s(times.get(0, []), fault_t)
    if start.step_s is not None:
        stalls = [stall_s(times.get(r, []), fault_t, start.step_s) for r in range(REPLICAS) if r != VICTIM]
        start.survivor_stall_s = round(max(stalls), 3)
        start.step_s = round(start.step_s, 3)
    survivors = [times.get(r, []) for r in range(REPLICAS) if r != VICTIM]
    taken = [full_strength_s(times[r], survivors, fault_t) for r in times if r == VICTIM or r >= REPLICAS]
    got = min((t for t in taken if t is not None), default=None)
    start.full_strength_s = None if got is None else round(got, 3)
    start.restart_phases_s = restart_phases(logs.get(VICTIM, ""), fault_t)
    return start


def digests(run_dir: Path, groups: int = REPLICAS) -> dict[int, str]:
    """The final model of each of ``groups`` groups that ended (``final-r<N>.pt``), as a digest
    of its tensors."""
    import torch

    out = {}
    for r in range(groups):
        path = run_dir / f"final-r{r}.pt"
        if path.exists():
            model = torch.load(path, weights_only=False)["model"]
            h = hashlib.sha256()
            for k in sorted(model):
                h.update(k.encode())
                h.update(model[k].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[r] = h.hexdigest()
    return out


def summarize(starts: list[Start]) -> dict[str, Any]:
    """One system's figures over its starts."""

    def median(key: str) -> float | None:
        vals = [getattr(s, key) for s in starts if getattr(s, key) is not None]
        return round(statistics.median(vals), 3) if vals else None

    return {
        "starts": len(starts),
        "crashes": sum(s.crashed for s in starts),
        "hangs": sum(s.hung for s in starts),
        "replicas_identical": sum(s.replicas_identical for s in starts),
        "survivor_stall_s": median("survivor_stall_s"),
        "full_strength_s": median("full_strength_s"),
        "step_s": median("step_s"),
        "restart_phases_s": {
            phase: round(statistics.median(vals), 3)
            for phase in ("imported", "initialized", "first_step")
            if (vals := [s.restart_phases_s[phase] for s in starts if phase in s.restart_phases_s])
        },
        "runs": [dataclasses.asdict(s) for s in starts],
    }


# -- the runs (processes) -----------------------------------------------------------------------


def titan_args(
    assets: Path, dump: Path, steps: int, semi_sync: str = "None", sync_steps: int = 2, groups: int = REPLICAS
) -> list[str]:
    """torchtitan's command line for one replica group (``--fault_tolerance.replica_id`` is added
    by the stand-ins' wrapper from the group's environment): per-step HSDP (``semi_sync``
    ``"None"``) or DiLoCo every ``sync_steps`` steps."""
    # one fragment: every sync carries the whole model, so replicas are equal after each one
    # (the debug config streams 2 fragments, and a sync then leaves the other one's local steps)
    semi = ["--fault_tolerance.sync_steps", str(sync_steps), "--fault_tolerance.num_fragments", "1"]
    semi = semi if semi_sync != "None" else []
    return [
        *("--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel"),
        "--fault_tolerance.enable",
        f"--fault_tolerance.group_size={groups}",
        *("--fault_tolerance.semi_sync_method", semi_sync, "--fault_tolerance.process_group", "gloo", *semi),
        *("--checkpoint.enable", "--checkpoint.interval", "1000"),
        *("--training.steps", str(steps)),
        *("--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "c4_test")),
        *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        *("--profiler.no-enable-profiling", "--validator.no-enable", "--dump_folder", str(dump)),
    ]


def upstream_path(root: Path) -> str:
    upstream = root / ".cache" / "upstream"
    if not (upstream / "torchtitan" / "experiments" / "torchft" / "trainer.py").exists():
        raise click.ClickException(
            f"torchtitan and torchft are not unpacked at {upstream}: run `make torchft-upstream`"
        )
    return os.pathsep.join(filter(None, [str(root), str(upstream), python_path()]))


def wait_for_step(log: Path, step: int, deadline: float, alive: Any) -> bool:
    while time.monotonic() < deadline and alive():
        text = log.read_text(errors="replace") if log.exists() else ""
        if any(s >= step for _, s in step_times(text)):
            return True
        time.sleep(0.1)
    return False


def inject(fault: str, pid: int) -> float:
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    return time.time()


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_unbroken(out: Path, assets: Path, args: Any, env: dict[str, str]) -> Start:
    start = Start("unbroken", args.fault)
    run_dir = out / "run"
    script = Path(__file__).with_name("titan_standins.py")
    groups = REPLICAS + args.hot_spares
    cmd = [sys.executable, "-m", "unbroken", "run", "--torchft-compat", "--replicas", str(REPLICAS)]
    cmd += ["--hot-spares", str(args.hot_spares)]
    cmd += ["--min-replicas", "1", "--run-dir", str(run_dir), "--", sys.executable, str(script)]
    cmd += titan_args(assets, out / "dump", args.steps, args.semi_sync, groups=groups)
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    with open(out / "run.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fault_t, victim = None, None
    try:
        if wait_for_step(run_dir / "logs" / f"replica{VICTIM}-rank0.log", 5, deadline, lambda: proc.poll() is None):
            events = read_jsonl(run_dir / "events.jsonl")
            victim = [e["pid"] for e in events if e["kind"] == "process_started" and e["replica"] == VICTIM][-1]
            fault_t = inject(args.fault, victim)
            if args.fault == "stop":
                while time.time() - fault_t < args.stop_s and proc.poll() is None:
                    time.sleep(0.1)
                resume(victim)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            start.hung, rc = True, None
    finally:
        stop_all([proc])
    start.wall_s = round(time.monotonic() - t0, 3)
    ended = list(read_jsonl(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    for e in ended:
        if e["kind"] == "process_exited" and e.get("exitcode") not in (0, None) and e.get("pid") != victim:
            # the supervisor's own kill of a group judged hung is -9 too: a survivor's is a fault
            start.crashed = True
            start.errors.append(f"replica {e['replica']} pid {e['pid']} exited with {e['exitcode']}")
    if rc not in (0, None):
        start.crashed = True
        start.errors.append(f"unbroken run exited with {rc}")
    logs = {r: _read(run_dir / "logs" / f"replica{r}-rank0.log") for r in range(groups)}
    found = digests(run_dir, groups)  # the groups that trained to the end: 3, spares included
    start.replicas_identical = len(found) == REPLICAS and len(set(found.values())) == 1
    return judge(start, logs, fault_t)


def run_torchft(out: Path, assets: Path, args: Any, env: dict[str, str]) -> Start:
    start = Start("torchft", args.fault)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lighthouse.py").write_text(LIGHTHOUSE)
    port = free_port()
    script = Path(__file__).with_name("titan_standins.py")
    procs: dict[int, subprocess.Popen[bytes]] = {}
    with open(out / "lighthouse.log", "wb") as lighthouse_log:
        lighthouse = subprocess.Popen(
            [sys.executable, str(out / "lighthouse.py"), "--min_replicas", "1", "--join_timeout_ms", "10000"]
            + ["--quorum_tick_ms", "100", "--bind", f"127.0.0.1:{port}"],
            env=env,
            stdout=lighthouse_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def launch(r: int) -> None:
        genv = dict(env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=str(r))
        genv.update(NUM_REPLICA_GROUPS=str(REPLICAS), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        genv.update(LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        genv["UNBROKEN_RUN_DIR"] = str(out)  # where the wrapper writes final-r<N>.pt (observation)
        # the threads unbroken run gives each worker (the cores split evenly), so that both sides
        # train at the same pace: the comparison is of fault tolerance, not thread settings
        genv.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // REPLICAS)))
        with open(out / f"replica{r}.log", "ab") as log:
            procs[r] = subprocess.Popen(
                [sys.executable, str(script), *titan_args(assets, out / "dump", args.steps, args.semi_sync)],
                env=genv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    for r in range(REPLICAS):
        launch(r)
    fault_t, victim, restarts = None, None, {r: 0 for r in range(REPLICAS)}
    done: set[int] = set()
    try:
        while len(done) < REPLICAS and time.monotonic() < deadline:
            if fault_t is None and any(s >= 5 for _, s in step_times(_read(out / f"replica{VICTIM}.log"))):
                victim = procs[VICTIM].pid
                fault_t = inject(args.fault, victim)
            if (
                args.fault == "stop"
                and fault_t is not None
                and victim is not None
                and time.time() - fault_t >= args.stop_s
            ):
                resume(victim)
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc is None or r in done:
                    continue
                if rc == 0:
                    done.add(r)
                    continue
                if p.pid != victim:
                    start.crashed = True
                    start.errors.append(
                        f"group {r} pid {p.pid} exited with {rc}: {_last_error(out / f'replica{r}.log')}"
                    )
                if restarts[r] >= args.max_restarts:
                    done.add(r)
                    continue
                restarts[r] += 1
                launch(r)  # torchrun --max-restarts: the group starts again
            time.sleep(0.1)
        start.hung = len(done) < REPLICAS
    finally:
        stop_all([*procs.values(), lighthouse])
    start.wall_s = round(time.monotonic() - t0, 3)
    logs = {r: _read(out / f"replica{r}.log") for r in range(REPLICAS)}
    found = digests(out)
    start.replicas_identical = len(found) == REPLICAS and len(set(found.values())) == 1
    return judge(start, logs, fault_t)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _last_error(log: Path) -> str:
    lines = [ln for ln in _read(log).splitlines() if "Error" in ln or "error" in ln]
    return lines[-1][-300:] if lines else "no error line"


@click.command()
@click.option("--starts", default=10, show_default=True, help="Starts of the job per system.")
@click.option(
    "--fault", type=click.Choice(FAULTS), default="kill", show_default=True, help="kill -9 or SIGSTOP group 1."
)
@click.option("--systems", default=",".join(SYSTEMS), show_default=True, help="Which to run, comma-separated.")
@click.option("--steps", default=40, show_default=True, help="torchtitan's --training.steps.")
@click.option(
    "--semi-sync",
    type=click.Choice(["None", "diloco"]),
    default="None",
    show_default=True,
    help="torchtitan's --fault_tolerance.semi_sync_method: per-step HSDP, or DiLoCo syncing every 2 steps.",
)
@click.option("--stop-s", default=20.0, show_default=True, help="With --fault stop: SIGCONT after this long.")
@click.option("--timeout-s", default=300.0, show_default=True, help="A start still running after this hung.")
@click.option("--max-restarts", default=3, show_default=True, help="torchft side: restarts per group (torchrun's).")
@click.option(
    "--hot-spares",
    default=0,
    show_default=True,
    help="unbroken side: groups started beyond the 3 that wait, model built, for a lost group's place.",
)
@click.option("--out", default="runs/bench/torchtitan.json", show_default=True, help="Where the JSON goes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def torchtitan(**kw: Any) -> None:
    """torchtitan's FaultTolerantTrainer through a fault, on unbroken and on torchft, side by side."""
    args: Any = types.SimpleNamespace(**kw)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        raise click.BadParameter(f"unknown systems {sorted(unknown)}: choose from {SYSTEMS}", param_hint="--systems")
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=upstream_path(root))
    from unbroken.bench.training.titan_standins import make_assets

    work = Path(args.out).with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    assets = work / "assets"
    make_assets(assets)
    results: dict[str, list[Start]] = {s: [] for s in systems}
    for i in range(args.starts):
        # alternate which system goes first: a machine that drifts slows both alike
        for system in systems if i % 2 == 0 else list(reversed(systems)):
            out = work / f"{system}-{i}"
            out.mkdir(parents=True)
            run = run_unbroken if system == "unbroken" else run_torchft
            s = run(out, assets, args, env)
            results[system].append(s)
            click.echo(json.dumps({"start": i, **dataclasses.asdict(s)}), err=True)
    result: dict[str, Any] = {
        "fault": args.fault,
        "replica_groups": REPLICAS,
        "steps": args.steps,
        "semi_sync": args.semi_sync,
        "hot_spares": args.hot_spares,
        "machine": f"{os.cpu_count()} cores, CPU (torch {_torch_version()})",
        **{s: summarize(results[s]) for s in systems},
    }
    publish(result, args.out, args.as_json)


def _torch_version() -> str:
    import torch

    return torch.__version__
