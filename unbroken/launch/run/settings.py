"""What ``unbroken run`` starts: its settings, checked before anything starts.

Apart from the supervisor (:mod:`unbroken.launch.run.launcher`) so that the command line
(:mod:`unbroken.launch.run.run_cli`), the demo and the benchmarks build and check a job's settings
without the supervisor's machinery, and so that every check of a user's input sits in one place:
a bad flag fails here, with the flag's name and what it accepts, before any replica starts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from unbroken import config as env
from unbroken.checkpoint.storage.disk import check_writable
from unbroken.control.coordinator import CoordinatorSettings
from unbroken.control.quorum.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S, JobHealth
from unbroken.diagnosis.rules.metrics import parse_policy
from unbroken.faults.schedule import Schedule
from unbroken.launch.policy import RestartPolicy, Slot
from unbroken.launch.recovery.verdicts import VERDICT_ACTIONS
from unbroken.launch.supervisor_core import DEFAULT_TERM_GRACE_S

HANG_ACTIONS = ("restart", "wait")


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What ``unbroken run`` starts.

    Attributes:
        command: the worker command line (``python train.py ...``).
        replicas: number of replica groups.
        ranks_per_replica: processes per replica group (its WORLD_SIZE).
        min_replicas: fewest replicas that may train; default a majority.
        run_dir: logs, events and the coordinator's state.
        coordinator: an external coordinator's HOST:PORT; None starts one in-process.
        port: the in-process coordinator's port (0: a free one).
        max_restarts: restarts allowed per replica before it is given up.
        threads_per_rank: torch threads per worker; default splits the cores evenly.
        policy: backoff, limits, crash loop, blame and re-admission (``max_restarts`` wins
            over ``policy.max_restarts_per_replica``).
        spares: spare slots a replica moves to when its node is isolated.
        hot_spares: replicas started beyond ``replicas`` that train only in a lost member's
            place: each runs the script up to its first quorum (imports, model, optimizer,
            connections) and waits there, parked by the coordinator; a lost member's place goes
            to one at the next epoch, which catches up from a peer, and the lost replica's
            restarted process waits as a spare in its turn. Their ids follow the replicas'.
        schedule: faults to inject.
        on_verdict: the strongest action a diagnosis verdict may take on its culprit (see
            :mod:`unbroken.launch.recovery.verdicts`): ``isolate`` (its node is isolated and the replica
            moves to a spare, or restarts in place if none is free; a ``suspect_hardware``
            replica moves only to a free spare, and otherwise stays), ``restart``, or ``ignore``.
        on_hang: a replica evicted for silence while its processes still run is killed and
            restarted (``restart``) or left to resume and rejoin by itself (``wait``).
        warm_spare: keep one worker process with torch already imported for restarts
            (``python script.py`` and ``python -m module`` commands; see launch/warm.py).
        checkpoint_dir: the job's checkpoint directory, handed to the workers; a ``rollback``
            verdict restarts every replica from a checkpoint found there.
        anomaly_policy: what training-metric anomalies do, over the default policy
            (``"nonfinite_loss=rollback"``; see :func:`unbroken.diagnosis.rules.metrics.parse_policy`),
            for the workers (skipping a step) and the coordinator's verdicts.
        term_grace_s: on SIGTERM, how long the workers have to finish their step and flush a
            checkpoint (:mod:`unbroken.train.preemption`) before what is left is killed.
        secret_file: the job's secret; None makes a fresh one in ``run_dir`` (required with an
            external ``coordinator``: the one it was started with).
        http_port: serve ``/metrics`` and the live dashboard on loopback at this port (0: a
            free one); None serves nothing (:mod:`unbroken.observe.http`).
        cross_replica_backend: ``auto``, ``nccl`` or ``gloo`` for the workers; None leaves the
            environment's (:mod:`unbroken.comm.backend`).
        torchft_compat: ``import torchft`` in the workers is :mod:`unbroken.torchft`
            (:mod:`unbroken.launch.run.torchft_compat`).
        fatal_epochs, no_progress_timeout_s: when the coordinator ends the job instead of
            looping (:mod:`unbroken.control.quorum.job_health`).
    """

    command: tuple[str, ...]
    replicas: int
    ranks_per_replica: int = 1
    min_replicas: int | None = None
    run_dir: Path = Path("runs/latest")
    coordinator: str | None = None
    port: int = 0
    max_restarts: int = 10
    threads_per_rank: int | None = None
    heartbeat_timeout_s: float = 2.0
    finish_grace_s: float = 10.0
    policy: RestartPolicy = RestartPolicy()
    spares: int = 0
    hot_spares: int = 0
    schedule: Schedule = Schedule()
    on_verdict: str = "isolate"
    on_hang: str = "restart"
    warm_spare: bool = True
    checkpoint_dir: Path | None = None
    anomaly_policy: str = ""
    term_grace_s: float = DEFAULT_TERM_GRACE_S
    secret_file: Path | None = None
    http_port: int | None = None
    cross_replica_backend: str | None = None
    torchft_compat: bool = False
    fatal_epochs: int = DEFAULT_FATAL_EPOCHS
    no_progress_timeout_s: float = DEFAULT_NO_PROGRESS_S

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError(
                "no worker command: put it after `--`, e.g. `unbroken run --replicas 3 -- python train.py`"
            )
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(
                f"--min-replicas must be between 1 and --replicas ({self.replicas}), got {self.min_replicas}"
            )
        if self.coordinator is not None:
            env.parse_host_ports(self.coordinator, "--coordinator")
            if self.secret_file is None and env.secret_file() is None:
                raise ValueError(
                    f"--coordinator needs the job's secret: --secret-file PATH (or {env.ENV_SECRET_FILE}), "
                    "the file `unbroken coordinator` wrote into its --state-dir"
                )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {self.spares}")
        if self.hot_spares < 0:
            raise ValueError(f"--hot-spares must be >= 0, got {self.hot_spares}")
        if self.on_verdict not in VERDICT_ACTIONS:
            raise ValueError(f"--on-verdict must be one of {', '.join(VERDICT_ACTIONS)}, got {self.on_verdict!r}")
        if not 0 <= self.term_grace_s < float("inf"):
            raise ValueError(f"--term-grace-s must be 0 or more seconds, got {self.term_grace_s}")
        env.check_seconds({"--heartbeat-timeout": self.heartbeat_timeout_s})  # NaN too, before any replica starts
        if self.on_hang not in HANG_ACTIONS:
            raise ValueError(f"--on-hang must be one of {', '.join(HANG_ACTIONS)}, got {self.on_hang!r}")
        if self.cross_replica_backend is not None:
            env.CrossReplicaBackend.parse(self.cross_replica_backend, "--cross-replica-backend")
        JobHealth(self.fatal_epochs, self.no_progress_timeout_s)  # the same checks as the coordinator's
        self.schedule.validate(self.replicas, self.ranks_per_replica, coordinator_in_process=self.coordinator is None)
        parse_policy(self.anomaly_policy)  # a typo fails here, with the kinds and actions it accepts
        if self.checkpoint_dir is not None:
            check_writable(str(self.checkpoint_dir))  # before any replica trains, not at its first save

    @property
    def processes(self) -> int:
        """Replica groups started: the replicas and the hot spares."""
        return self.replicas + self.hot_spares

    @property
    def quorum_min(self) -> int:
        return self.min_replicas if self.min_replicas is not None else self.replicas // 2 + 1

    def threads(self) -> int:
        """Torch threads per worker: ``threads_per_rank``, or this machine's cores split evenly."""
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // (self.replicas * self.ranks_per_replica))

    def coordinator_settings(self, port: int) -> CoordinatorSettings:
        """The in-process coordinator's settings, on loopback at ``port``, its state in ``run_dir``."""
        return CoordinatorSettings(
            total_replicas=self.processes,
            max_members=self.replicas if self.hot_spares else None,
            min_replicas=self.quorum_min,
            state_dir=self.run_dir,
            host="127.0.0.1",
            port=port,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            anomaly_policy=self.anomaly_policy,
            fatal_epochs=self.fatal_epochs,
            no_progress_timeout_s=self.no_progress_timeout_s,
        )


def local_slots(replicas: int, spares: int) -> list[Slot]:
    """One machine's slots, each its own fault domain (``local-0`` ...), spares last."""
    return [Slot(f"local-{i}", 0, spare=i >= replicas) for i in range(replicas + spares)]
