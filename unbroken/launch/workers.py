"""One node's worker processes: their environment, their start, their end.

Shared by the single-machine supervisor (:mod:`unbroken.launch.run.launcher`) and the per-node agent
(:mod:`unbroken.launch.node.agent`), so both start and end workers the same way. Every worker runs in
its own session, so the whole tree it spawned can be ended by its session id; on Linux it asks
the kernel for ``SIGKILL`` when its parent dies, and the supervisor's guardian
(:mod:`unbroken.launch.reaper`) ends the rest of its tree, so a supervisor or agent killed with
``kill -9`` leaves nothing training on without anyone watching it.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from unbroken import config as env
from unbroken.launch import reaper

_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class ReplicaProcs:
    """One replica's processes on this node, and how often they were restarted."""

    replica: int
    procs: list[asyncio.subprocess.Process] = dataclasses.field(default_factory=list)
    restarts: int = 0
    step_at_start: int = 0  # the job's step when they were started: progress is measured from it


@dataclasses.dataclass
class SupervisedReplica(ReplicaProcs):
    """A replica as the single-machine supervisor tracks it: its pending restart, and the
    checkpoint its next processes load after a rollback (:mod:`unbroken.launch.recovery.rollback`)."""

    pending: asyncio.Task[None] | None = None
    resume_step: int | None = None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL this process when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(137)


def _announce(fd: int) -> None:
    """Runs in the child between fork and exec: tells the guardian (:mod:`unbroken.launch.reaper`)
    this new session, before the child can start anything. The supervisor tells it too, once
    it is back from the fork; a ``kill -9`` of the supervisor in between left a worker's child
    (a trainer behind a shell) unknown to the guardian, alive."""
    try:
        pipe = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a guardian gone: no SIGPIPE death
    except ValueError:  # not the interpreter's main thread: the supervisor's own word must do
        return
    try:
        os.write(fd, b"+%d\n" % os.getpid())
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGPIPE, pipe)


def die_with_parent(announce_to: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that ties a child's life to ours, where the OS supports it; with
    ``announce_to`` (the guardian's pipe), it also tells the guardian its session first."""
    if not sys.platform.startswith("linux"):
        return None
    if announce_to is None:
        return _die_with_parent

    def preexec() -> None:
        _die_with_parent()
        _announce(announce_to)

    return preexec


def package_path() -> dict[str, str]:
    """PYTHONPATH for helper processes (``python -m unbroken...``) to import this very package."""
    root = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, env.python_path()]))}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (Linux), None if none does.

    Gloo binds its pairs to one interface (``GLOO_SOCKET_IFNAME``); without it, it takes the one
    the host name resolves to, often loopback, which peers on other nodes cannot dial.
    """
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def worker_environ(settings: env.WorkerSettings, one_machine: bool = False) -> dict[str, str]:
    """The environment a worker starts with: this process's, with ``settings`` written in
    (:meth:`unbroken.config.WorkerSettings.to_env`).

    ``one_machine``: the whole job runs on this machine (``unbroken run``), so NCCL's and Gloo's
    own sockets, which unbroken cannot authenticate, are bound to loopback
    (:func:`loopback_env`) unless the user chose their interfaces.
    """
    environ = settings.to_env(os.environ)
    if one_machine:
        environ.update(loopback_env(os.environ))
    return environ


def loopback_env(environ: Mapping[str, str], ifname: str | None = None) -> dict[str, str]:
    """``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` set to the loopback interface, each
    unless ``environ`` sets it already (the user's choice wins).

    Without them NCCL binds its bootstrap and socket transport, and a group a script builds
    itself binds Gloo's pairs, to the interface the host name resolves to: a one-machine job
    would then listen, unauthenticated, where other machines reach it.
    """
    lo = ifname or interface_of("127.0.0.1") or "lo"
    return {name: lo for name in (env.ENV_NCCL_SOCKET_IFNAME, env.ENV_GLOO_SOCKET_IFNAME) if not environ.get(name)}


async def start_worker(
    command: tuple[str, ...], environ: dict[str, str], log_path: Path, guardian: reaper.Guardian | None = None
) -> asyncio.subprocess.Process:
    """Starts one worker in its own session, its output appended to ``log_path``; the guardian
    ends that session if this process dies."""
    if shutil.which(command[0], path=environ.get("PATH", os.defpath)) is None:
        # Before the fork: a child whose exec fails has told the guardian a session that ends at
        # once, and whose id a later, unrelated process may take.
        raise ValueError(f"cannot start the worker command {command[0]!r}: not found, or not executable")
    log = open(log_path, "ab")  # noqa: SIM115
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            env=environ,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(guardian.fileno() if guardian is not None else None),
        )
    except FileNotFoundError as e:
        raise ValueError(f"cannot start the worker command {command[0]!r}: {e.strerror}") from e
    finally:
        log.close()
    if guardian is not None:
        guardian.add(proc.pid)
    return proc


def forward_sigterm(procs: list[asyncio.subprocess.Process]) -> None:
    """SIGCONT then SIGTERM to each worker's process group, as Slurm does: a stopped worker must
    run to flush its checkpoint (:mod:`unbroken.train.preemption`)."""
    for p in procs:
        if p.returncode is not None:
            continue
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


SESSION_END_S = 10.0  # how long ending a worker waits for the last of its session to die


async def kill_groups(procs: list[asyncio.subprocess.Process], guardian: reaper.Guardian | None = None) -> None:
    """Ends each worker and everything in its session, and reaps them.

    Waits (bounded) until the sessions are empty: a replacement started earlier could meet a
    descendant of the old worker still holding its port or its memory.
    """
    sessions = [p.pid for p in procs]
    reaper.kill_sessions(sessions)
    for p in procs:
        await p.wait()
    deadline = asyncio.get_running_loop().time() + SESSION_END_S
    while True:
        reaper.reap_orphans(sessions)  # descendants we adopted as their parents died
        if not reaper.kill_sessions(sessions) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.01)
    reaper.reap_orphans(sessions)
    if guardian is not None:
        for sid in sessions:
            guardian.remove(sid)
