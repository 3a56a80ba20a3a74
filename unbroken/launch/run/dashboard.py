"""The dashboard and ``/metrics`` of an ``unbroken run`` job (``--http-port``).

Served from the run directory's events and rows (:class:`unbroken.observe.live.JobView`) and
the coordinator's status: asked on the supervisor's loop when the coordinator runs in it, over
its port when it is external. Apart from the supervisor so that it reads as supervision; the
observe modules are imported only when a job asks for the dashboard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.wire.auth import JobSecret

if TYPE_CHECKING:
    from unbroken.observe.http import ObserveServer


def serve(
    run_dir: Path,
    replicas: int,
    port: int,
    secret: JobSecret,
    coordinator: str | None,
    local_status: Callable[[], dict[str, Any] | None],
) -> ObserveServer:
    """Starts the server on loopback at ``port`` (0: a free one).

    Args:
        coordinator: an external coordinator's address; None asks ``local_status`` instead, on
            the running loop (the in-process coordinator's status, or None while it is down).
    """
    from unbroken.control.status import fetch_status
    from unbroken.observe import http
    from unbroken.observe.live import JobView

    view = JobView(run_dir, replicas=replicas)
    status: http.Status
    if coordinator is not None:
        address = coordinator

        def status() -> dict[str, Any] | None:
            return _or_none(fetch_status, address, secret)

    else:
        status = http.on_loop(asyncio.get_running_loop(), local_status)
    return http.ObserveServer("127.0.0.1", port, view, status, http.read_token(secret.key)).start()


def _or_none(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any] | None:
    try:
        return fn(*args)
    except (OSError, ValueError):
        return None
