"""torchft's ``LighthouseServer``, as an unbroken coordinator in this process.

torchft's tests and small setups start a lighthouse in the test process
(``LighthouseServer(bind="[::]:0", min_replicas=2)``) and run replicas as threads that reach it at
``lighthouse.address()``. Here that starts unbroken's coordinator on a thread of its own (its
asyncio loop), with a fresh job secret that Managers of this process given that address use.
Under ``unbroken run`` the launcher's coordinator plays the lighthouse and this is not needed.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.wire.auth import JobSecret

# The most replica ids a lighthouse admits (0..N-1): torchft's lighthouse has no such bound,
# unbroken's coordinator needs one.
DEFAULT_TOTAL_REPLICAS = 16

_SECRETS: dict[str, JobSecret] = {}  # "host:port" of a lighthouse of this process -> its secret
_LOCK = threading.Lock()


def coordinator_address(lighthouse_addr: str) -> str:
    """``host:port`` of a lighthouse address (``http://host:port`` as torchft writes it)."""
    return lighthouse_addr.removeprefix("http://").removeprefix("https://").rstrip("/")


def secret_of(lighthouse_addr: str) -> JobSecret | None:
    """The job secret of a lighthouse this process started, None for any other address."""
    with _LOCK:
        return _SECRETS.get(coordinator_address(lighthouse_addr))


class LighthouseServer:
    """An unbroken coordinator standing in for torchft's lighthouse.

    Args:
        bind: ``[::]:PORT`` or ``HOST:PORT``; the port (0: a free one) is used, on loopback.
        min_replicas: the fewest replicas a quorum has (``--min-replicas``).
        join_timeout_ms: how long the first quorum waits for more than ``min_replicas``.
        total_replicas: replica ids are 0..total_replicas-1.
        quorum_tick_ms, heartbeat_timeout_ms: torchft's; the second is the eviction timeout.
    """

    def __init__(
        self,
        bind: str = "[::]:0",
        min_replicas: int = 1,
        join_timeout_ms: int = 1000,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int = 2000,
        total_replicas: int = DEFAULT_TOTAL_REPLICAS,
        **_: Any,
    ) -> None:
        port = int(bind.rsplit(":", 1)[1]) if ":" in bind else 0
        self._secret = JobSecret.generate()
        self._dir = tempfile.mkdtemp(prefix="unbroken-lighthouse-")
        settings = CoordinatorSettings(
            total_replicas=total_replicas,
            min_replicas=min_replicas,
            state_dir=Path(self._dir),
            port=port,
            heartbeat_timeout_s=heartbeat_timeout_ms / 1000,
            startup_window_s=join_timeout_ms / 1000,
        )
        self._loop = asyncio.new_event_loop()
        self._coordinator = Coordinator(settings, self._secret)
        self._stopped = threading.Event()
        started: Future[None] = Future()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="unbroken-lighthouse", daemon=True)
        self._thread.start()
        started.result(timeout=30)
        self._address = self._coordinator.address
        with _LOCK:
            _SECRETS[self._address] = self._secret

    def _serve(self, started: Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._coordinator.start())
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's thread
            started.set_exception(e)
            return
        started.set_result(None)
        self._loop.run_forever()
        self._loop.run_until_complete(self._coordinator.stop())
        self._loop.close()

    def address(self) -> str:
        """Where Managers reach it, as torchft writes it: ``http://host:port``."""
        return f"http://{self._address}"

    def shutdown(self) -> None:
        """Stops the coordinator (safe to call twice)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with _LOCK:
            _SECRETS.pop(self._address, None)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)
