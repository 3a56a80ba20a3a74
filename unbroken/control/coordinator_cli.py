"""``unbroken coordinator``: run the coordinator on its own (multi-node jobs, or a restart).

It needs the job's secret: ``--secret-file``, or the ``secret`` file of ``--state-dir`` (made
there on first start and kept, so a coordinator restarted on the same directory takes back the
agents and workers that still run with it). Agents on other nodes get it with their own
``--secret-file``.

``--standby`` runs a second coordinator on the same ``--state-dir`` (a shared filesystem with
working ``flock`` when it runs on another node) at its own address. It waits, without
listening, until the active coordinator's process is gone (the kernel drops its lock on the
state directory, :func:`~unbroken.control.state_store.wait_for_state_dir`), then takes the
directory over: its epochs start above every epoch the active one reserved, so none is ever
reused. Workers and agents given both addresses (``--coordinator A,B``) reconnect to whichever
listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from unbroken.control import event_loop
from unbroken.control import secret_file as secrets
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.job_health import DEFAULT_FATAL_EPOCHS, DEFAULT_NO_PROGRESS_S
from unbroken.control.state_store import JOURNAL_MODES, wait_for_state_dir
from unbroken.wire.auth import JobSecret

# A standalone coordinator's port: a fixed one that agents and workers can be told in advance
# (the coordinator inside `unbroken run` takes any free port, CoordinatorSettings.port).
DEFAULT_PORT = 29510


async def _serve(
    settings: CoordinatorSettings, secret: JobSecret, secret_path: Path, http_port: int | None, standby: bool = False
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    lock_fd = None
    if standby:
        click.echo(f"standby: waiting for the active coordinator on {settings.state_dir} to stop", err=True)
        given_up = threading.Event()
        waiting = asyncio.ensure_future(asyncio.to_thread(wait_for_state_dir, settings.state_dir, given_up))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        given_up.set()
        stopping.cancel()
        lock_fd = await waiting
        if lock_fd is None:
            return
        took_over = time.monotonic()
    coordinator = Coordinator(settings, secret, lock_fd=lock_fd)
    await coordinator.start()
    if standby:
        click.echo(f"standby took over in {time.monotonic() - took_over:.3f}s", err=True)
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
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
    if server is not None:
        server.close()
    await coordinator.stop()


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
    help="Seconds the first quorum waits for every replica.",
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
    "--standby",
    is_flag=True,
    help="Wait until the active coordinator on the same --state-dir is gone, then take over at --host:--port "
    "(give workers and agents both addresses: --coordinator ACTIVE,STANDBY).",
)
def coordinator(
    fatal_epochs: int,
    no_progress_timeout: float,
    replicas: int,
    min_replicas: int | None,
    host: str,
    port: int,
    state_dir: Path,
    heartbeat_timeout: float,
    startup_window: float,
    journal_mode: str,
    secret_file: Path | None,
    http_port: int | None,
    max_connections: int,
    standby: bool,
) -> None:
    """Serve membership and quorum epochs for a job; state persists in --state-dir."""
    try:
        settings = CoordinatorSettings(
            total_replicas=replicas,
            min_replicas=min_replicas if min_replicas is not None else replicas // 2 + 1,
            state_dir=state_dir,
            host=host,
            port=port,
            heartbeat_timeout_s=heartbeat_timeout,
            startup_window_s=startup_window,
            journal_mode=journal_mode,
            max_connections=max_connections,
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
        event_loop.run(_serve(settings, secret, path, http_port, standby))
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
