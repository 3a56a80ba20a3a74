"""How a coordinator runs: the settings of ``unbroken coordinator`` and of ``unbroken run``'s own.

Checked when made (durations finite and positive), so a bad flag fails at start with its name,
not as a coordinator that never evicts anyone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from unbroken.config import check_seconds
from unbroken.control.quorum.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S
from unbroken.control.state.state_store import KEEP_EVENTS


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator runs.

    Attributes:
        total_replicas: replicas the job is configured with.
        min_replicas: fewest replicas that may train.
        state_dir: where epochs and events persist (SQLite) and events.jsonl is written.
        host: address to bind; loopback unless the job spans machines.
        port: port to bind; 0 picks a free one.
        heartbeat_timeout_s: a replica silent this long is evicted (a stopped process).
        suspect_after_s: a replica silent this long is not waited for when a new epoch forms
            (five missed heartbeats); it stays alive, and counted, until the timeout above.
        join_window_floor_s: the join window never drops below this; above it the window is
            three median step times, learned from what replicas report.
        startup_window_s: how long the first quorum waits for every configured replica (and a
            restarted coordinator for the members of the epoch it resumes: control.resume).
        finish_grace_s: node agents are told the job is over this long after the first replica
            finished, even if a replica is still catching up (with no donor left it never can).
        anomaly_policy: actions for training-metric anomalies over the default, as in
            ``UNBROKEN_ANOMALY_POLICY`` (which is read when this is empty).
        journal_mode: SQLite journal of the state store: ``delete`` (safe on a shared
            filesystem), ``truncate``, or ``wal`` (local disks only).
        keep_events: the newest events the state store keeps.
        max_connections: connections served at once (replicas' ranks, agents, status
            clients); more are closed at once.
        hello_timeout_s: an authenticated connection that has not said who it is (``hello``,
            ``agent_hello``) or asked for ``status`` within this is closed.
        max_world_size: the most ranks a replica may announce.
        heartbeat_s: how often each rank heartbeats (told in the welcome), while the job is small.
        max_heartbeats_per_s: heartbeat lines a second the coordinator spends on at most: past
            it the period and both silences above grow (:mod:`unbroken.control.quorum.heartbeat`).
        max_asks_per_s: quorum requests a second the coordinator spends on at most: past it, fast
            answers to relayed ranks stand for several steps (:mod:`unbroken.control.quorum.grants`).
        max_grant_s: the longest such an answer stands, in seconds (a newcomer waits up to it).
        fatal_epochs: epochs in a row failed by a configuration error at every member that end
            the job (:mod:`unbroken.control.quorum.job_health`).
        no_progress_timeout_s: seconds without a committed step that end the job; 0 never.
        max_members: the most replicas an epoch trains with (None: all); the others are hot
            spares, each taking a lost member's place in the next epoch
            (:mod:`unbroken.control.quorum.rules`).
    """

    total_replicas: int
    min_replicas: int = 1
    state_dir: Path = Path("unbroken-state")
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_timeout_s: float = 2.0
    suspect_after_s: float = 0.5
    join_window_floor_s: float = 0.5
    startup_window_s: float = 20.0
    finish_grace_s: float = 10.0
    anomaly_policy: str = ""
    journal_mode: str = "delete"
    keep_events: int = KEEP_EVENTS
    max_connections: int = 1024
    hello_timeout_s: float = 10.0
    max_world_size: int = 4096
    heartbeat_s: float = 0.1
    max_heartbeats_per_s: float = 2000.0
    max_asks_per_s: float = 2000.0
    max_grant_s: float = 10.0
    fatal_epochs: int = DEFAULT_FATAL_EPOCHS
    no_progress_timeout_s: float = DEFAULT_NO_PROGRESS_S
    max_members: int | None = None

    def __post_init__(self) -> None:
        names = ("heartbeat_timeout_s", "suspect_after_s", "join_window_floor_s", "startup_window_s", "hello_timeout_s")
        check_seconds({n: getattr(self, n) for n in (*names, "heartbeat_s", "max_grant_s")})  # NaN included
        if not self.max_asks_per_s > 0:
            raise ValueError(f"max_asks_per_s must be > 0, got {self.max_asks_per_s}")
        check_seconds({"finish_grace_s": self.finish_grace_s}, zero_ok=True)
