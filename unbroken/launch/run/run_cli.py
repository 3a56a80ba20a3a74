"""``unbroken run``: the fault-tolerant replacement for ``torchrun``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from unbroken.control.coordinator_cli import job_health_options
from unbroken.faults.schedule import Schedule
from unbroken.launch.options import cross_replica_backend_option
from unbroken.launch.policy import RestartPolicy
from unbroken.launch.recovery.verdicts import VERDICT_ACTIONS
from unbroken.launch.run.launcher import run as run_job
from unbroken.launch.run.settings import DEFAULT_TERM_GRACE_S, HANG_ACTIONS, LaunchSettings


def supervisor_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The policy and fault options shared by ``unbroken run`` and ``unbroken demo``."""
    options = [
        click.option(
            "--spares",
            type=int,
            default=0,
            show_default=True,
            help="Spare slots a replica moves to when its node is isolated.",
        ),
        click.option(
            "--hot-spares",
            type=int,
            default=0,
            show_default=True,
            help="Replicas started beyond --replicas that wait, model built and connected, to take a "
            "lost replica's place at the next step (they catch up from a peer); the lost one's "
            "restart waits as a spare in its turn.",
        ),
        click.option(
            "--fault",
            "faults",
            multiple=True,
            metavar="KIND:key=value,...",
            help="Inject a fault, e.g. crash:replica=1,step=40 (repeatable; see unbroken.faults.schedule).",
        ),
        click.option(
            "--faults-file",
            "fault_files",
            multiple=True,
            type=click.Path(path_type=Path),
            help="A YAML/JSON fault schedule (repeatable).",
        ),
        click.option(
            "--on-verdict",
            type=click.Choice(VERDICT_ACTIONS),
            default="isolate",
            show_default=True,
            help="What a diagnosis verdict does to its culprit replica.",
        ),
        click.option(
            "--on-hang",
            type=click.Choice(HANG_ACTIONS),
            default="restart",
            show_default=True,
            help="A replica silent while its processes run: kill and restart it, or wait for it.",
        ),
        click.option(
            "--backoff",
            type=float,
            default=RestartPolicy.backoff_initial_s,
            show_default=True,
            help="First restart delay in seconds; doubles per failure without progress.",
        ),
        click.option("--max-job-restarts", type=int, default=RestartPolicy.max_restarts_per_job, show_default=True),
        click.option(
            "--crash-loop-restarts",
            type=int,
            default=RestartPolicy.crash_loop_restarts,
            show_default=True,
            help="Restarts with no committed step that end the job (exit code 93).",
        ),
        click.option(
            "--blame-threshold",
            type=int,
            default=RestartPolicy.blame_threshold,
            show_default=True,
            help="Faults on one node within --blame-window that isolate it.",
        ),
        click.option("--blame-window", type=float, default=RestartPolicy.blame_window_s, show_default=True),
        click.option(
            "--checkpoint-dir",
            type=click.Path(path_type=Path),
            default=None,
            help="The job's checkpoint directory (UNBROKEN_CHECKPOINT_DIR for the workers); "
            "a rollback verdict restarts the job from a checkpoint there.",
        ),
        click.option(
            "--anomaly-policy",
            default="",
            metavar="KIND=ACTION,...",
            help="Actions for training-metric anomalies, e.g. nonfinite_loss=rollback,loss_spike=skip_step "
            "(actions: skip_step, rollback, isolate, none).",
        ),
        click.option(
            "--readmit-after",
            type=float,
            default=RestartPolicy.readmit_after_s,
            show_default=True,
            help="Seconds an isolated node waits before the self-check that can re-admit it.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def supervisor_settings(kw: dict[str, Any]) -> dict[str, Any]:
    """Turns the options above into LaunchSettings fields (raises ValueError on bad input)."""
    backoff = kw.pop("backoff")
    policy = RestartPolicy(
        backoff_initial_s=backoff,
        backoff_max_s=max(RestartPolicy.backoff_max_s, backoff),
        max_restarts_per_job=kw.pop("max_job_restarts"),
        crash_loop_restarts=kw.pop("crash_loop_restarts"),
        blame_threshold=kw.pop("blame_threshold"),
        blame_window_s=kw.pop("blame_window"),
        readmit_after_s=kw.pop("readmit_after"),
    )
    schedule = Schedule.build(files=kw.pop("fault_files"), flags=kw.pop("faults"))
    return {
        "policy": policy,
        "schedule": schedule,
        "spares": kw.pop("spares"),
        "hot_spares": kw.pop("hot_spares"),
        "on_verdict": kw.pop("on_verdict"),
        "on_hang": kw.pop("on_hang"),
        "checkpoint_dir": kw.pop("checkpoint_dir"),
        "anomaly_policy": kw.pop("anomaly_policy"),
    }


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--replicas", type=int, required=True, help="Number of data-parallel replica groups.")
@click.option(
    "--ranks-per-replica",
    type=int,
    default=LaunchSettings.ranks_per_replica,
    show_default=True,
    help="Processes per replica group.",
)
@click.option("--min-replicas", type=int, default=None, help="Fewest replicas that may train [default: a majority].")
@click.option("--run-dir", type=click.Path(path_type=Path), default=LaunchSettings.run_dir, show_default=True)
@click.option("--coordinator", default=None, help="HOST:PORT of an external coordinator (else one starts here).")
@click.option("--port", type=int, default=0, help="Port of the in-process coordinator (0: a free one).")
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's secret (0600; `unbroken secret new PATH`) [default: a fresh one in --run-dir; "
    "with --coordinator, the one it was started with].",
)
@click.option(
    "--max-restarts", type=int, default=LaunchSettings.max_restarts, show_default=True, help="Restarts per replica."
)
@click.option(
    "--term-grace-s",
    type=float,
    default=DEFAULT_TERM_GRACE_S,
    show_default=True,
    help="On SIGTERM (preemption, scancel, eviction): seconds the workers have to finish their step "
    "and flush a checkpoint before the rest is killed.",
)
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="Serve /metrics (Prometheus) and a live dashboard on 127.0.0.1 at this port (0: a free one); "
    "the dashboard's URL, with the job's read-only token, is printed [default: none].",
)
@click.option(
    "--torchft-compat",
    is_flag=True,
    default=False,
    help="Run torchft and torchtitan scripts unchanged: `import torchft` in the workers is unbroken's "
    "facade, unbroken.torchft (docs/torchtitan.md).",
)
@cross_replica_backend_option
@job_health_options
@supervisor_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(**kw: Any) -> None:
    """Run COMMAND as fault-tolerant replicas: `unbroken run --replicas 3 -- python train.py`.

    Exit codes: 0 done, 1 no replica finished, 78 a configuration that can never work (every member
    of --fatal-epochs epochs in a row failed with it; the error and a hint are printed), 93 crash
    loop, 94 job restart limit, 95 no step committed for --no-progress-timeout, 130 Ctrl-C, 143
    SIGTERM (the workers were told to flush a checkpoint; run the same command to resume).
    """
    try:
        kw["no_progress_timeout_s"] = kw.pop("no_progress_timeout")
        extra = supervisor_settings(kw)
        settings = LaunchSettings(command=kw.pop("command"), **kw, **extra)
        code = run_job(settings)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
    sys.exit(code)
