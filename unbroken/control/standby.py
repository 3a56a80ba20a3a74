"""A standby coordinator: it listens beside the active one and waits for its turn.

``unbroken coordinator --standby`` runs one on the active coordinator's state directory (a shared
filesystem) at its own address. It listens from the start, without serving: each node agent keeps
an authenticated connection to it and says its node's hello on it beforehand
(:class:`~unbroken.control.nodes.node_relay.PreSaid`), so that a takeover costs no accept, handshake
or parse per node. It waits, in a thread (:func:`~unbroken.control.state.lease.wait_for_takeover`),
until the active coordinator's process is gone (its lock on the state directory is free) or its
lease lapsed (it hangs); what it won (:class:`~unbroken.control.state.lease.Takeover`) and the
connections it holds are what the coordinator it becomes is built with.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from unbroken.control.coordinator import listen
from unbroken.control.coordinator_settings import CoordinatorSettings
from unbroken.control.nodes.node_relay import PreSaid
from unbroken.control.protocol.serving import ConnectionServer
from unbroken.control.state import lease
from unbroken.wire.auth import JobSecret


class Standby:
    """Holds the node agents' connections and waits for the active coordinator to go.

    Args:
        settings: the coordinator it becomes (its address, state directory, limits).
        secret: the job's secret (connections must prove it).
        store: where the lease lives (the state directory's files, or etcd).
        lease_s: how long the active coordinator's lease must stand unchanged before it is taken.
        gives_up_s: how long the lease store may fail before :meth:`wait` raises
            :class:`~unbroken.control.state.lease.LeaseStoreFailed` (None: the default).
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        secret: JobSecret,
        store: lease.LeaseStore,
        lease_s: float = lease.DEFAULT_LEASE_S,
        gives_up_s: float | None = None,
    ) -> None:
        self.settings, self.secret, self.store = settings, secret, store
        self.lease_s, self.gives_up_s = lease_s, gives_up_s
        self.presaid = PreSaid(settings.host)
        self.listening: tuple[ConnectionServer[Any, Any], asyncio.base_events.Server] | None = None

    async def listen(self) -> None:
        """Binds the standby's address now: node agents keep a connection to it, which it serves
        once it takes over (:meth:`ConnectionServer.hold`)."""
        held: ConnectionServer[Any, Any] = ConnectionServer(
            self.secret,
            self.settings.max_connections,
            self.settings.hello_timeout_s,
            dispatch=lambda msg, link, conn, agent: ("stop", conn, agent),
            closed=lambda conn, agent: None,
            what="the standby",
        )
        held.hold(self.presaid)
        self.listening = (held, await listen(self.settings, held))

    @property
    def address(self) -> str:
        assert self.listening is not None, "call listen() first"
        host, port = self.listening[1].sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def wait(self, stop: asyncio.Event) -> lease.Takeover | None:
        """Until the active coordinator is gone (what was won) or ``stop`` is set (None).

        Raises:
            LeaseStoreFailed: the lease store failed for longer than ``gives_up_s``.
        """
        given_up = threading.Event()
        waiting = asyncio.ensure_future(
            asyncio.to_thread(
                lease.wait_for_takeover,
                self.settings.state_dir,
                given_up,
                self.lease_s,
                files=self.store,
                gives_up_s=self.gives_up_s,
            )
        )
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up.set()
            stopping.cancel()
        return await waiting

    def close(self) -> None:
        """Stops listening and drops the held connections (a standby that did not take over)."""
        if self.listening is not None:
            self.listening[1].close()
            self.listening[0].close_all()
            self.listening = None
