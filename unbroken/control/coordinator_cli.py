"""``unbroken coordinator``: run the coordinator on its own (multi-node jobs, or a restart).

It needs the job's secret: ``--secret-file``, or the ``secret`` file of ``--state-dir`` (made
there on first start and kept, so a coordinator restarted on the same directory takes back the
agents and workers that still run with it). Agents on other nodes get it with their own
``--secret-file``.

``--standby`` runs a second coordinator on the same ``--state-dir`` (a shared filesystem with
working ``flock`` when it runs on another node) at its own address. It waits, without
listening, until the active coordinator's process is gone (the kernel drops its lock on the
state directory) or its lease lapsed (it hangs: :mod:`unbroken.control.state.lease`), then takes the
directory over: its epochs start above every epoch the active one reserved, so none is ever
reused. Workers and agents given both addresses (``--coordinator A,B``) reconnect to whichever
listens. A coordinator that wakes up after its lease lapsed answers nothing (its fence is
checked before every answer), finds the next term at its next renewal, and exits with
:data:`STEPPED_DOWN`. One whose lease store keeps failing exits with
:data:`~unbroken.control.state.lease.EXIT_LEASE_STORE` (74), so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.protocol import event_loop
from unbroken.control.protocol.serving import FENCE_POLL_S
from unbroken.control.quorum.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S
from unbroken.control.standby import Standby
from unbroken.control.state import lease
from unbroken.control.state import secret_file as secrets
from unbroken.control.state.state_store import JOURNAL_MODES, lock_state_dir, private_dir
from unbroken.wire.auth import JobSecret

# A standalone coordinator's port: a fixed one that agents and workers can be told in advance
# (the coordinator inside `unbroken run` takes any free port, CoordinatorSettings.port).
DEFAULT_PORT = 29510
# The exit code of a coordinator that found its lease taken by another (it hung past it): it
# answered nothing after the lease lapsed, and stopped.
STEPPED_DOWN = 75


async def _serve(
    settings: CoordinatorSettings,
    secret: JobSecret,
    secret_path: Path,
    http_port: int | None,
    standby: bool = False,
    lease_s: float = lease.DEFAULT_LEASE_S,
    renew_s: float = lease.DEFAULT_RENEW_S,
    files: lease.LeaseStore | None = None,
) -> int:
    """Serves until SIGINT/SIGTERM (0), or until the lease went to another coordinator
    (:data:`STEPPED_DOWN`), or its store failed (:data:`~unbroken.control.state.lease.EXIT_LEASE_STORE`)."""
    stop = asyncio.Event()
    signalled = threading.Event()  # stopped by SIGINT/SIGTERM: exit 0, whatever the lease says
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal, signalled, stop)
    files = lease.LeaseFiles(settings.state_dir) if files is None else files
    listening = presaid = None
    if standby:
        waiter = Standby(settings, secret, files, lease_s)
        await waiter.listen()
        click.echo(f"standby: waiting for the active coordinator on {settings.state_dir} to stop", err=True)
        try:
            takeover = await waiter.wait(stop)
        except lease.LeaseStoreFailed as e:
            click.echo(f"standby: giving up: {e}", err=True)
            waiter.close()
            return lease.EXIT_LEASE_STORE
        if takeover is None:
            waiter.close()
            return 0
        listening, presaid = waiter.listening, waiter.presaid
        took_over = time.monotonic()
        how = "its process is gone" if takeover.lock_fd is not None else "its lease lapsed (it hangs)"
        click.echo(f"standby: taking over term {takeover.lease.term}: {how}", err=True)
        lock_fd, claimed, started, active_at = (
            takeover.lock_fd,
            takeover.lease,
            takeover.claim_started,
            takeover.active_at,
        )
    else:
        # The lock first: a coordinator refused for a held directory must not claim a term.
        private_dir(Path(settings.state_dir))
        lock_fd = lock_state_dir(Path(settings.state_dir))
        try:
            claimed, started = lease.claim_next(files, lease_s)
        except OSError as e:
            click.echo(f"cannot claim the lease in {files.where}: {e}", err=True)
            return lease.EXIT_LEASE_STORE
        active_at = 0.0
    lost = threading.Event()

    def on_lost(to: lease.Lease | None) -> None:
        lost.set()
        with contextlib.suppress(RuntimeError):  # the loop closed already: stopping anyway
            loop.call_soon_threadsafe(stop.set)

    keeper = lease.LeaseKeeper(files, claimed, started, renew_s, active_at, on_lost)
    coordinator = Coordinator(
        settings,
        secret,
        lock_fd=lock_fd,
        fence=keeper.valid,
        held_by_lease=lock_fd is None,
        listening=listening,
        presaid=presaid,
        term=claimed.term,
    )
    keeper.start()
    settling = None
    if standby:  # the takeover's burst: see event_loop.release_gc_when
        running = event_loop.hold_gc()
        settling = asyncio.ensure_future(
            event_loop.release_gc_when(lambda: coordinator.resumed is None, settings.startup_window_s + 1.0, running)
        )
    try:
        await coordinator.start()
    except BaseException:
        keeper.stop()
        if settling is not None:
            settling.cancel()
        raise
    if standby:
        click.echo(f"standby took over in {time.monotonic() - took_over:.3f}s", err=True)
    click.echo(f"lease term {claimed.term} held in {settings.state_dir}", err=True)
    click.echo(f"coordinator listening on {coordinator.address}", err=True)
    server = None
    if http_port is not None:
        from unbroken.observe import http
        from unbroken.observe.live import JobView

        view = JobView(settings.state_dir, replicas=settings.total_replicas)
        status = http.on_loop(asyncio.get_running_loop(), coordinator.status)
        server = http.ObserveServer(settings.host, http_port, view, status, http.read_token(secret.key)).start()
        click.echo(f"dashboard {server.url} (metrics: /metrics, same token)", err=True)
    click.echo(f"job secret: {secret_path} (agents and workers on other nodes need it: --secret-file)", err=True)
    adopting = asyncio.ensure_future(_adopt_lock(coordinator, renew_s)) if lock_fd is None else None
    gave_up = threading.Event()
    store_failed = asyncio.ensure_future(_watch_store(keeper, renew_s, stop, gave_up))
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
    store_failed.cancel()
    if adopting is not None:
        adopting.cancel()
    if settling is not None:
        settling.cancel()
    keeper.stop()
    if server is not None:
        server.close()
    # Not stopped by a signal: its lease went (or its store failed). One more look at the store
    # decides which, after the keeper's last renewal: a renewal that was in flight when the process
    # was stopped may land after the watchdog gave up, and the term may have gone meanwhile.
    failed = not signalled.is_set() and gave_up.is_set()
    replaced = lost.is_set() or (not signalled.is_set() and keeper.replaced())
    try:
        await coordinator.stop(abort=replaced or failed)
        await asyncio.sleep(2 * FENCE_POLL_S)  # lines that waited for the lease see their connections closed
    except OSError as e:  # its state lives on the store that failed: what it could not write is lost anyway
        if not failed:
            raise
        click.echo(f"closing the state on the failed store: {e}", err=True)
    if replaced:
        to = keeper.lost_to
        click.echo(
            f"stepped down: the lease went to term {to.term if to else '?'} ({to.holder if to else 'unknown'}); "
            f"{coordinator.fenced_off} message(s) and tick(s) left unanswered since it lapsed",
            err=True,
        )
        return STEPPED_DOWN
    if failed:
        bound = lease.store_gives_up_after(claimed.lease_s, renew_s)
        click.echo(
            f"exiting: the lease store {files.where} failed for {bound}s ({keeper.renew_failures} failed "
            "renewal(s)); a standby takes over, a supervisor restarts this one",
            err=True,
        )
        return lease.EXIT_LEASE_STORE
    return 0


def _on_signal(signalled: threading.Event, stop: asyncio.Event) -> None:
    signalled.set()
    stop.set()


async def _watch_store(
    keeper: lease.LeaseKeeper, every_s: float, stop: asyncio.Event, gave_up: threading.Event
) -> None:
    """Stops the coordinator once its lease store failed past the bound (errors, or a call that
    never returns in the keeper's thread): never a coordinator that is silently fenced forever."""
    while not keeper.gave_up():
        await asyncio.sleep(every_s)
    gave_up.set()
    stop.set()


def lease_store(url: str, state_dir: Path) -> lease.LeaseStore:
    """The store ``--lease-store`` names: ``file`` (the state directory) or ``etcd://HOST:PORT/NAME``."""
    if url == "file":
        return lease.LeaseFiles(state_dir)
    if url.startswith("etcd://"):
        from unbroken.control.state.lease_etcd import LeaseEtcd

        return LeaseEtcd(url)
    raise ValueError(f"--lease-store {url!r}: write file, or etcd://HOST:PORT/NAME")


def _fit_lease(store: lease.LeaseStore, state_dir: Path, lease_s: float, renew_s: float) -> tuple[float, float]:
    """Refuses a state directory whose mount cannot hold a lease; widens the lease on a slow store,
    saying why (a standby widens too, on the same store; its record tells others its periods)."""
    if isinstance(store, lease.LeaseFiles):
        mount = lease.mount_of(state_dir)
        if mount is not None and (problem := lease.mount_problem(*mount)) is not None:
            raise ValueError(problem)
    probe = store.probe()
    lease_s, renew_s, why = lease.fit_to_store(lease_s, renew_s, probe.latency_s)
    if why is not None:
        click.echo(f"lease: {why}", err=True)
    if probe.timestamp_ns >= 1_000_000:
        click.echo(
            f"lease: {state_dir} keeps timestamps to {probe.timestamp_ns / 1e9:g}s; the lease does not rely on them",
            err=True,
        )
    return lease_s, renew_s


async def _adopt_lock(coordinator: Coordinator, every_s: float) -> None:
    """Takes the state directory's lock once the hung coordinator replaced through the lease
    is gone (its process ended: the kernel dropped its lock)."""
    while not coordinator.store.adopt_lock():
        await asyncio.sleep(every_s)
    click.echo("took the state directory's lock: the coordinator replaced is gone", err=True)


def job_health_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """When the coordinator ends a job instead of looping (``unbroken run``, ``unbroken coordinator``)."""
    fn = click.option(
        "--no-progress-timeout",
        type=float,
        default=DEFAULT_NO_PROGRESS_S,
        show_default=True,
        help="Seconds without a committed step after which the job ends (exit code 95); 0: never.",
    )(fn)
    return click.option(
        "--fatal-epochs",
        type=click.IntRange(1, 3),
        default=DEFAULT_FATAL_EPOCHS,
        show_default=True,
        help="Epochs in a row whose every member fails with an error no retry can mend (NCCL invalid usage, "
        "an interface that does not exist) after which the job ends (exit code 78).",
    )(fn)


@click.command()
@job_health_options
@click.option("--replicas", type=int, required=True, help="Replicas the job is configured with.")
@click.option("--min-replicas", type=int, default=None, help="Fewest replicas that may train [default: a majority].")
@click.option(
    "--hot-spares",
    type=int,
    default=0,
    show_default=True,
    help="Replica groups beyond --replicas that agents run as spares: each waits, model built, to take a "
    "lost replica's place at the next step; epochs never have more than --replicas members.",
)
@click.option("--host", default=CoordinatorSettings.host, show_default=True)
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--state-dir", type=click.Path(path_type=Path), default=Path("runs/coordinator"), show_default=True)
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=CoordinatorSettings.heartbeat_timeout_s,
    show_default=True,
    help="Seconds of silence before eviction.",
)
@click.option(
    "--startup-window",
    type=float,
    default=CoordinatorSettings.startup_window_s,
    show_default=True,
    help="Seconds the first quorum waits for every replica (a restarted coordinator: for the members "
    "of the epoch it continues).",
)
@click.option(
    "--journal-mode",
    type=click.Choice(JOURNAL_MODES),
    default=CoordinatorSettings.journal_mode,
    show_default=True,
    help="SQLite journal of --state-dir: delete is safe on a shared filesystem; wal only on a local disk.",
)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's secret (0600; `unbroken secret new PATH`) [default: $UNBROKEN_SECRET_FILE, else "
    "--state-dir/secret, made if missing].",
)
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="Serve /metrics and the live dashboard on --host at this port (0: a free one) [default: none].",
)
@click.option(
    "--max-connections",
    type=int,
    default=CoordinatorSettings.max_connections,
    show_default=True,
    help="Connections served at once: every rank of every replica, the agents, status clients.",
)
@click.option(
    "--max-asks-per-s",
    type=float,
    default=CoordinatorSettings.max_asks_per_s,
    show_default=True,
    help="Quorum requests a second the coordinator spends on at most: past it, answers to ranks behind a "
    "node agent's relay stand for several steps and the relay answers those itself (a newcomer then "
    "waits up to that many steps longer to be admitted).",
)
@click.option(
    "--standby",
    is_flag=True,
    help="Wait until the active coordinator on the same --state-dir is gone, then take over at --host:--port "
    "(give workers and agents both addresses: --coordinator ACTIVE,STANDBY).",
)
@click.option(
    "--lease",
    "lease_s",
    type=float,
    default=lease.DEFAULT_LEASE_S,
    show_default=True,
    help="Seconds the active coordinator's lease lasts: a standby takes over from one that hangs this long "
    "(and the hung one, when it wakes up, steps down without answering).",
)
@click.option(
    "--lease-renew",
    "renew_s",
    type=float,
    default=lease.DEFAULT_RENEW_S,
    show_default=True,
    help="Seconds between renewals of the lease (at most half of --lease).",
)
@click.option(
    "--lease-store",
    "lease_store_url",
    default="file",
    show_default=True,
    metavar="file|etcd://HOST:PORT/NAME",
    help="Where the lease lives: the state directory (file), or an etcd cluster under the job's NAME "
    "(needs the [etcd] extra; the state directory stays on the shared filesystem).",
)
def coordinator(
    fatal_epochs: int,
    no_progress_timeout: float,
    replicas: int,
    min_replicas: int | None,
    hot_spares: int,
    host: str,
    port: int,
    state_dir: Path,
    heartbeat_timeout: float,
    startup_window: float,
    journal_mode: str,
    secret_file: Path | None,
    http_port: int | None,
    max_connections: int,
    max_asks_per_s: float,
    standby: bool,
    lease_s: float,
    renew_s: float,
    lease_store_url: str,
) -> None:
    """Serve membership and quorum epochs for a job; state persists in --state-dir."""
    os.umask(0o077)  # the state directory, its database, leases, secret and events: 0700/0600
    try:
        private_dir(state_dir)
        if hot_spares < 0:
            raise click.BadParameter(f"must be >= 0, got {hot_spares}", param_hint="--hot-spares")
        settings = CoordinatorSettings(
            total_replicas=replicas + hot_spares,
            max_members=replicas if hot_spares else None,
            min_replicas=min_replicas if min_replicas is not None else replicas // 2 + 1,
            state_dir=state_dir,
            host=host,
            port=port,
            heartbeat_timeout_s=heartbeat_timeout,
            startup_window_s=startup_window,
            journal_mode=journal_mode,
            max_connections=max_connections,
            max_asks_per_s=max_asks_per_s,
            fatal_epochs=fatal_epochs,
            no_progress_timeout_s=no_progress_timeout,
        )
        found = secrets.given(secret_file)
        if found is None and standby and not (state_dir / secrets.SECRET_NAME).exists():
            raise ValueError(
                f"a standby needs the job's secret: start the active coordinator on {state_dir} first "
                "(it writes the secret there), or give --secret-file"
            )
        secret, path = found if found is not None else secrets.kept(state_dir)
        event_loop.pace_gc_for_a_server()
        lease.check_periods(lease_s, renew_s)
        store = lease_store(lease_store_url, state_dir)
        lease_s, renew_s = _fit_lease(store, state_dir, lease_s, renew_s)
        code = event_loop.run(_serve(settings, secret, path, http_port, standby, lease_s, renew_s, store))
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
    if code:
        raise SystemExit(code)
