"""N hosts as Linux network namespaces joined by veth pairs to one bridge (the "switch").

Every host, and the coordinator's host, is a namespace with its own address in the
benchmarking range 198.18.0.0/15 (RFC 2544), which exists only inside the namespaces made
here. Faults are the kernel's, not ours:

* node loss: every process in a host's namespace killed at once with ``SIGKILL`` (a power cut;
  the kernel still closes their sockets, as a real machine's peers see a crash, not a cable cut);
* partition: a host's link down (its veth on the switch side: from everyone), or two hosts made
  unreachable from each other only (each given a permanent neighbour entry with a MAC nobody
  has: frames go nowhere, silently, as in a real partition; ``heal`` restores the entry);
* slow link: the ``tbf`` qdisc on both ends of a host's veth (``netem`` is not built into every
  kernel; ``tbf`` is).

``Box(n, paths=2)`` gives every host a second interface (``eth1``) on a second bridge and subnet
(198.19.0.0/16): a backup path, as a host with two NIC ports on two planes has. Link faults and
shaping then take the interface (``eth0``, the default, or ``eth1``).

The box ends only processes started in its own namespaces, and deletes everything it created
on :meth:`Box.close` (a ``with`` block calls it even when the test fails). Names carry the
creating process's id (``u<pid>x<n>-h0``), so boxes of concurrent runs never meet, and a box
left behind by a run that was killed is swept by the next one (namespaces only, and only once
no process is left in them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

SUBNET = "198.18.0.0/16"
SUBNET2 = "198.19.0.0/16"  # the second path's plane (Box(paths=2))
PREFIX_LEN = 16
INTERFACES = ("eth0", "eth1")
COORDINATOR_ADDR = "198.18.0.1"
NOWHERE_MAC = "02:00:00:00:00:01"  # a locally administered address no interface in the box has
_NAME = re.compile(r"^u(\d+)x(\d+)-")
_counter = itertools.count()


class BoxUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no ``ip``, no permission)."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the box: its namespace, its address, and its veth's end on the switch."""

    name: str
    netns: str
    addr: str
    veth: str
    addr2: str = ""  # eth1's address, with a second path
    veth2: str = ""  # eth1's veth end on the second bridge

    def switch_end(self, interface: str) -> str:
        """The veth end on the switch of this host's ``interface``."""
        if interface == "eth0":
            return self.veth
        if interface == "eth1" and self.veth2:
            return self.veth2
        raise ValueError(f"host {self.name} has no interface {interface!r} (it has {', '.join(self.interfaces)})")

    @property
    def interfaces(self) -> tuple[str, ...]:
        return INTERFACES if self.veth2 else INTERFACES[:1]


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


LOSS_TABLE = "unbroken_loss"


def nft_path() -> str | None:
    """The ``nft`` binary (it lives in /usr/sbin, which a user's PATH may not hold), or None."""
    return shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")


def unavailable() -> str | None:
    """Why no box can be built here, or None when it can (tried for real: one namespace made and
    deleted)."""
    if os.geteuid() != 0:
        return "the cluster box needs root (network namespaces, veth, bridge, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the cluster box needs `{tool}` (iproute2)"
    probe = f"u{os.getpid()}x{next(_counter)}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError) as e:
        return f"cannot create a network namespace: {e}"
    with contextlib.suppress(RuntimeError, OSError):
        _run("ip", "netns", "del", probe)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Deletes namespaces that boxes of dead processes left behind (a run killed with
    ``SIGKILL``); only empty ones. Returns their names."""
    swept = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        if _run("ip", "netns", "pids", name).split():
            continue  # something still runs there: not ours to end
        with contextlib.suppress(RuntimeError):
            _run("ip", "netns", "del", name)
            swept.append(name)
    return swept


class Box:
    """``hosts`` host namespaces plus the coordinator's, on one bridge. Use as a context manager.

    Attributes:
        hosts: the hosts, ``h0``... by name.
        coordinator: the coordinator's host (``ctl``), 198.18.0.1.
    """

    def __init__(self, hosts: int, paths: int = 1) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"a box holds 1 to 200 hosts, got {hosts}")
        if paths not in (1, 2):
            raise ValueError(f"a box's hosts have 1 or 2 paths (interfaces), got {paths}")
        self.tag = f"u{os.getpid()}x{next(_counter)}"
        self.bridge = f"{self.tag}b"
        self.bridge2 = f"{self.tag}c" if paths == 2 else ""
        self.coordinator = Host(
            "ctl",
            f"{self.tag}-ctl",
            COORDINATOR_ADDR,
            f"{self.tag}vc",
            "198.19.0.1" if paths == 2 else "",
            f"{self.tag}wc" if paths == 2 else "",
        )
        self.hosts = {
            f"h{i}": Host(
                f"h{i}",
                f"{self.tag}-h{i}",
                f"198.18.0.{10 + i}",
                f"{self.tag}v{i}",
                f"198.19.0.{10 + i}" if paths == 2 else "",
                f"{self.tag}w{i}" if paths == 2 else "",
            )
            for i in range(hosts)
        }
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._procs: list[subprocess.Popen[bytes]] = []
        self._slow: set[str] = set()

    def __enter__(self) -> Box:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        if name == "ctl":
            return self.coordinator
        try:
            return self.hosts[name]
        except KeyError:
            raise ValueError(f"no host {name!r} in this box (hosts: ctl, {', '.join(self.hosts)})") from None

    # -- building and tearing down ---------------------------------------------------------

    def create(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            sweep_stale()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for h in [self.coordinator, *self.hosts.values()]:
            _run("ip", "netns", "add", h.netns)
            self._made.append(("netns", h.netns))
            _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            self._made.append(("link", h.veth))
            _run("ip", "link", "set", h.veth, "master", self.bridge, "up")
            _run("ip", "-n", h.netns, "link", "set", "lo", "up")
            _run("ip", "-n", h.netns, "addr", "add", f"{h.addr}/{PREFIX_LEN}", "dev", "eth0")
            _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
        if self.bridge2:
            _run("ip", "link", "add", self.bridge2, "type", "bridge")
            self._made.append(("link", self.bridge2))
            _run("ip", "link", "set", self.bridge2, "up")
            for h in [self.coordinator, *self.hosts.values()]:
                _run("ip", "link", "add", h.veth2, "type", "veth", "peer", "name", "eth1", "netns", h.netns)
                self._made.append(("link", h.veth2))
                _run("ip", "link", "set", h.veth2, "master", self.bridge2, "up")
                _run("ip", "-n", h.netns, "addr", "add", f"{h.addr2}/{PREFIX_LEN}", "dev", "eth1")
                _run("ip", "-n", h.netns, "link", "set", "eth1", "up")

    def close(self) -> None:
        """Ends every process in the box's namespaces, then deletes what it made (idempotent)."""
        for kind, name in self._made:
            if kind == "netns":
                self._kill_all(name)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for kind, name in reversed(self._made):
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            with contextlib.suppress(RuntimeError, OSError):
                _run(*cmd)
        self._made.clear()

    def _kill_all(self, netns: str) -> list[int]:
        try:
            pids = [int(p) for p in _run("ip", "netns", "pids", netns).split()]
        except RuntimeError:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # -- processes -------------------------------------------------------------------------

    def spawn(
        self, host: str, argv: Sequence[str], log: Path | IO[bytes], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts ``argv`` on ``host`` (in its namespace, in a session of its own)."""
        h = self.host(host)
        out = open(log, "ab") if isinstance(log, Path) else log  # noqa: SIM115
        try:
            p = subprocess.Popen(
                ["ip", "netns", "exec", h.netns, *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if isinstance(log, Path):
                out.close()
        self._procs.append(p)
        return p

    def pids(self, host: str) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", self.host(host).netns).split()]

    # -- faults ----------------------------------------------------------------------------

    def power_cut(self, host: str) -> list[int]:
        """Every process on ``host`` killed at once (``SIGKILL``); returns their pids. The host's
        link stays up: its peers see closed connections, as after a crash."""
        pids = self._kill_all(self.host(host).netns)
        for p in self._procs:
            if p.pid in pids:
                p.wait(10)
        return pids

    def link_down(self, host: str, interface: str = "eth0") -> None:
        """``host``'s ``interface`` cut off from its switch: the veth's end there goes down (with
        one path, the host is cut off from everyone)."""
        _run("ip", "link", "set", self.host(host).switch_end(interface), "down")

    def link_up(self, host: str, interface: str = "eth0") -> None:
        _run("ip", "link", "set", self.host(host).switch_end(interface), "up")

    def cut(self, a: str, b: str) -> None:
        """``a`` and ``b`` no longer reach each other (both still reach everyone else)."""
        ha, hb = self.host(a), self.host(b)
        for src, dst in ((ha, hb), (hb, ha)):
            _run(
                "ip",
                "-n",
                src.netns,
                "neigh",
                "replace",
                dst.addr,
                "lladdr",
                NOWHERE_MAC,
                "dev",
                "eth0",
                "nud",
                "permanent",
            )

    def heal(self, a: str, b: str) -> None:
        ha, hb = self.host(a), self.host(b)
        for src, dst in ((ha, hb), (hb, ha)):
            with contextlib.suppress(RuntimeError):
                _run("ip", "-n", src.netns, "neigh", "del", dst.addr, "dev", "eth0")

    def slow(self, host: str, rate: str = "20mbit", interface: str = "eth0", burst: str = "32kb") -> None:
        """Shapes ``host``'s ``interface`` to ``rate`` in both directions with the kernel's ``tbf``."""
        h = self.host(host)
        shape = ("root", "tbf", "rate", rate, "burst", burst, "latency", "200ms")
        _run("tc", "qdisc", "replace", "dev", h.switch_end(interface), *shape)  # towards the host
        _run("tc", "-n", h.netns, "qdisc", "replace", "dev", interface, *shape)  # from the host
        self._slow.add(host)

    def lossy(self, host: str, percent: float, interface: str = "eth0") -> None:
        """Drops ``percent`` of ``host``'s packets on ``interface``, both ways, in its kernel (an
        nftables rule drawing a random number per packet), as a failing cable or optic does: TCP
        retransmits, and transfers through it slow down or stall. ``netem`` is not built into
        every kernel (this VM's lacks it); nftables is. Needs ``nft`` (``make nftables``)."""
        if not 0 < percent < 100:
            raise ValueError(f"percent must be in (0, 100), got {percent}")
        nft = nft_path()
        if nft is None:
            raise RuntimeError("dropping packets needs `nft` (Debian's nftables): `make nftables` installs it")
        h = self.host(host)
        per_mille = max(1, round(percent * 10))
        ns = ("ip", "netns", "exec", h.netns, nft)
        _run(*ns, "add", "table", "inet", LOSS_TABLE)
        for chain, hook, match in (("from_host", "output", "oifname"), ("to_host", "input", "iifname")):
            _run(
                *ns,
                "add",
                "chain",
                "inet",
                LOSS_TABLE,
                chain,
                "{",
                "type",
                "filter",
                "hook",
                hook,
                "priority",
                "0",
                ";",
                "}",
            )
            _run(
                *ns,
                "add",
                "rule",
                "inet",
                LOSS_TABLE,
                chain,
                match,
                interface,
                "numgen",
                "random",
                "mod",
                "1000",
                "<",
                str(per_mille),
                "drop",
            )

    def lossless(self, host: str) -> None:
        """Undoes :meth:`lossy` (the rules also go with the host's namespace)."""
        nft = nft_path()
        if nft is not None:
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "exec", self.host(host).netns, nft, "delete", "table", "inet", LOSS_TABLE)

    def unslow(self, host: str, interface: str = "eth0") -> None:
        h = self.host(host)
        with contextlib.suppress(RuntimeError):
            _run("tc", "qdisc", "del", "dev", h.switch_end(interface), "root")
        with contextlib.suppress(RuntimeError):
            _run("tc", "-n", h.netns, "qdisc", "del", "dev", interface, "root")
        self._slow.discard(host)

    def wait_reachable(self, a: str, b: str, port: int, timeout: float = 10.0) -> None:
        """Waits until a TCP listener at ``b``:``port`` answers from ``a`` (bounded)."""
        deadline = time.monotonic() + timeout
        hb = self.host(b)
        probe = f"import socket; socket.create_connection(('{hb.addr}', {port}), timeout=1).close()"
        while True:
            done = subprocess.run(
                ["ip", "netns", "exec", self.host(a).netns, sys.executable, "-c", probe],
                capture_output=True,
                timeout=10,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{b}:{port} not reachable from {a} within {timeout}s")
            time.sleep(0.1)
