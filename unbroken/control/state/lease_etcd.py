"""The coordinator's lease kept in etcd, for sites that run it (``--lease-store etcd://HOST:PORT/NAME``).

The same records and rules as the file store (:mod:`unbroken.control.state.lease`), one key per term
under ``/unbroken/<NAME>/lease/``: a claim is etcd's create-if-absent transaction (one claimant
wins a term, linearizably), a renewal a compare-and-swap of the holder's own record against the
one it wrote last (it fails once a later holder pruned the key), a read a linearizable get. etcd
keeps no timestamp the lease could trust, and none is read: the standby counts on its own clock,
as on a filesystem. The state directory (its lock, its SQLite) stays on the shared filesystem.

The client is ``etcd3gw`` (etcd's HTTP gateway, ``/v3``): no gRPC stack on the coordinator's
node, and the ``[etcd]`` extra only where etcd is used. Every client or server error is an
OSError to the lease's rules, so a failing etcd is retried and then given up on exactly as a
failing filesystem is.
"""

from __future__ import annotations

import errno
import functools
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from unbroken.control.state.lease import Lease, StoreProbe, to_prune

T = TypeVar("T")
_URL = re.compile(
    r"^etcd://(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})/(?P<name>[A-Za-z0-9_.\-]{1,64})$"
)
DEFAULT_TIMEOUT_S = 1.0  # one call's limit: a renewal must fit in a renewal period


def parse_url(url: str) -> tuple[str, int, str]:
    """``etcd://HOST:PORT/NAME`` -> (host, port, name). Raises ValueError saying what to write."""
    m = _URL.match(url)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(
            f"--lease-store {url!r}: write etcd://HOST:PORT/NAME, NAME the job's own (letters, digits, '.', '_', '-'): "
            "two jobs on one etcd must not share a lease"
        )
    return m["host"].strip("[]"), int(m["port"]), m["name"]


class LeaseEtcd:
    """The terms' records in etcd (:class:`~unbroken.control.state.lease.LeaseStore`).

    Args:
        url: ``etcd://HOST:PORT/NAME``.
        timeout_s: each call's limit.
        client: an ``etcd3gw`` client (built from ``url`` when None).
    """

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, client: Any = None) -> None:
        host, port, name = parse_url(url)
        if client is None:
            try:
                from etcd3gw.client import Etcd3Client
            except ImportError as e:
                raise ValueError(f"--lease-store {url}: needs the etcd client: pip install 'unbroken[etcd]'") from e
            client = Etcd3Client(host=host, port=port, timeout=timeout_s, api_path="/v3/")
        self.client = client
        self.prefix = f"/unbroken/{name}/lease/"
        self.where = f"etcd {host}:{port} {self.prefix}"
        self._written: dict[int, bytes] = {}  # the record this process last wrote, per term (its CAS)

    def key(self, term: int) -> str:
        return f"{self.prefix}{term:018d}"  # zero-padded: etcd's key order is the terms' order

    def terms(self) -> list[int]:
        kvs = self._call(lambda: self.client.get_prefix(self.prefix))
        out = []
        for _, meta in kvs:
            tail = _text(meta.get("key", b""))[len(self.prefix) :]
            if tail.isdigit() and len(tail) <= 18:
                out.append(int(tail))
        return sorted(out)

    def read(self, term: int) -> Lease | None:
        values = self._call(lambda: self.client.get(self.key(term)))
        if not values:
            return None
        try:
            lease = Lease.from_json(_text(values[0]))
        except ValueError:
            return None
        return lease if lease.term == term else None

    def newest(self) -> Lease | None:
        terms = self.terms()
        return self.read(terms[-1]) if terms else None

    def claim(self, lease: Lease) -> bool:
        record = lease.record()
        if not self._call(lambda: self.client.create(self.key(lease.term), record)):
            return False
        self._written = {lease.term: record}
        for old in to_prune(self.terms()):
            key = self.key(old)
            self._call(functools.partial(self.client.delete, key))
        return True

    def renew(self, lease: Lease) -> None:
        """Swaps the holder's record for the next one if it is still the one it wrote; raises
        OSError otherwise (pruned by a later holder) and when etcd fails."""
        before = self._written.get(lease.term)
        record = lease.record()
        if before is None:
            raise OSError(errno.EPERM, f"term {lease.term} was not claimed by this process")
        if not self._call(lambda: self.client.replace(self.key(lease.term), before, record)):
            raise OSError(
                errno.ESTALE, f"the record of term {lease.term} in {self.where} is not this holder's any more"
            )
        self._written[lease.term] = record

    def probe(self, rounds: int = 5) -> StoreProbe:
        """A renewal's calls timed: a read of the prefix and a key, as a renewal does."""
        latency = 0.0
        for _ in range(rounds):
            t0 = time.monotonic()
            self.terms()
            self._call(lambda: self.client.get(self.key(0)))
            latency = max(latency, time.monotonic() - t0)
        return StoreProbe(timestamp_ns=1, latency_s=latency)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except OSError:
            raise
        except Exception as e:  # etcd3gw's and requests' errors: a failing store, to the lease's rules
            raise OSError(errno.EIO, f"etcd: {type(e).__name__}: {e}") from e


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
