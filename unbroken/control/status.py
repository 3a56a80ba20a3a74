"""``unbroken status``: a live table of a running job, from its coordinator and its event log.

The coordinator answers the ``status`` op (membership, epoch, each replica's step and compute
time); the run directory's ``events.jsonl``, read as typed events into the same
:class:`~unbroken.observe.live.JobView` that ``/metrics`` and the dashboard show, adds each
replica's lifecycle state and its last event. Either alone works; both give the full table.
Asking the coordinator takes the job's secret (``--secret-file``, or the ``secret`` file of the run directory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from unbroken.config import ConfigError, parse_host_port
from unbroken.control import protocol
from unbroken.control.state import secret_file as secrets
from unbroken.observe import schema as ev
from unbroken.observe.events import read_typed
from unbroken.observe.live import JobView
from unbroken.wire.auth import JobSecret

COLUMNS = ("replica", "state", "node", "epoch", "step", "step_s", "last_event")


def fetch_status(address: str, secret: JobSecret, timeout: float = 2.0) -> dict[str, Any]:
    """Asks the coordinator at ``address`` for its status (one authenticated request, one answer)."""
    host, port = parse_host_port(address, "--coordinator")
    return protocol.request(host, port, secret, {"op": "status"}, timeout)


def status_rows(status: Mapping[str, Any] | None, view: JobView) -> list[dict[str, Any]]:
    """One row per replica: state, epoch, step, compute time, last event; from the same view of
    the typed events that the dashboard and ``/metrics`` show (:class:`JobView`)."""
    state = view.state(status)
    epoch = (status or {}).get("epoch")
    members = set(state["job"]["members"])
    return [
        {
            "replica": r["replica"],
            "state": r["state"],
            "node": r["node"],
            "epoch": epoch if r["replica"] in members and status is not None else None,
            "step": r["step"],
            "step_s": r["step_s"],
            "last_event": r["last_event"],
        }
        for r in state["replicas"]
    ]


def coordinator_from_events(events: Iterable[ev.Event]) -> str | None:
    address = None
    for e in events:
        if isinstance(e, (ev.CoordinatorStarted, ev.CoordinatorRestarted)) and e.address:
            address = e.address
    return address


def render(
    rows: list[dict[str, Any]], status: dict[str, Any] | None, error: str | None, failed: dict[str, Any] | None = None
) -> Table:
    title = "unbroken status"
    if status is not None:
        title += f" - epoch {status.get('epoch')}, step {status.get('step')}, members {status.get('members')}"
    failed = failed or (status or {}).get("job_failed")
    if failed:
        title += f" - [red]JOB FAILED (exit {failed.get('exit_code')}): {failed.get('reason')}[/]"
    if error:
        title += f" - [red]{error}[/]"
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for row in rows:
        step_s = row["step_s"]
        table.add_row(
            *(str(row[c]) if row[c] is not None else "" for c in ("replica", "state", "node", "epoch", "step")),
            f"{step_s:.3f}" if step_s else "",
            row["last_event"],
        )
    return table


@click.command()
@click.option(
    "--coordinator", default=None, help="HOST:PORT of the job's coordinator [default: from --run-dir's events]."
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=Path("runs/latest"),
    show_default=True,
    help="The job's run directory (for lifecycle states and events).",
)
@click.option("--watch/--once", default=True, show_default=True, help="Refresh live until Ctrl-C, or print once.")
@click.option("--interval", type=float, default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the rows once as JSON.")
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's secret [default: $UNBROKEN_SECRET_FILE, else --run-dir/secret].",
)
def status(
    coordinator: str | None, run_dir: Path, watch: bool, interval: float, as_json: bool, secret_file: Path | None
) -> None:
    """Show a running job: replicas, state, epoch, step, step time, last event."""
    if coordinator is not None:
        try:
            parse_host_port(coordinator, "--coordinator")
        except ConfigError as e:
            raise click.UsageError(str(e)) from e
    elif not (run_dir / "events.jsonl").exists():
        raise click.UsageError(f"no events in {run_dir}: pass --run-dir of a job, or --coordinator HOST:PORT")
    secret: JobSecret | None = None
    no_secret = ""
    try:
        secret = secrets.for_client(secret_file, run_dir)
    except ConfigError as e:
        if coordinator is not None or secret_file is not None:
            raise click.UsageError(str(e)) from e
        no_secret = str(e)  # the events still make a table; the coordinator is not asked

    view = JobView(run_dir)

    def snapshot() -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None, dict[str, Any] | None]:
        address = coordinator or coordinator_from_events(read_typed(run_dir / "events.jsonl"))
        view.refresh()
        st, error = None, None
        if address and secret is None:
            error = no_secret
        elif address and secret is not None:
            try:
                st = fetch_status(address, secret)
            except OSError as e:
                error = f"coordinator {address} unreachable ({e})"
        return status_rows(st, view), st, error, (st or {}).get("job_failed") or view.job.get("failed")

    if as_json:
        rows, st, error, failed = snapshot()
        click.echo(json.dumps({"rows": rows, "coordinator": st, "error": error, "job_failed": failed}))
        return
    console = Console()
    if not watch:
        console.print(render(*snapshot()))
        return
    with Live(render(*snapshot()), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(*snapshot()))
        except KeyboardInterrupt:
            pass
