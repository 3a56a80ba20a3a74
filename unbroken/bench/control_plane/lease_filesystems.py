"""``unbroken bench lease``: the coordinator's lease on real filesystems that lie.

Real parts only: an active ``unbroken coordinator`` and a ``--standby`` (processes) on one state
directory, on

- ``ext4-128``: a loop-mounted ext4 made with ``-I 128`` (whole-second timestamps);
- ``vfat``: a FAT filesystem image mounted by ``fusefat`` (2 s timestamps, no hard links; this
  kernel has no vfat module, and a FUSE filesystem is what many sites' storage is anyway);
- ``tmp``: the machine's own filesystem;

each optionally under :mod:`unbroken.bench.control_plane.faultfs` (FUSE), which adds latency to every call,
stalls them all, or fails them with ``EIO`` for one process. Scenarios:

- ``live``: both run for a number of renewals; a takeover of the live holder is a failure.
  Then the active is stopped (SIGSTOP): the standby must take over within the target.
- ``store_fails``: the active's lease calls fail with ``EIO`` from an instant on: it must exit
  with :data:`~unbroken.control.state.lease.EXIT_LEASE_STORE` within two lease periods, and the
  standby answer (a status request) within the takeover target.
- ``stall``: members connected to the active send a heartbeat every 0.1 s while every call of
  the filesystem stalls for 0.5 s: no connection may drop, no replica be evicted.

Needs root (loop mounts, FUSE) and ``make lease-fs`` (dosfstools, fuse3, mfusepy). What is
missing is reported as skipped, with the reason, never counted as passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from unbroken.bench.control_plane.faultfs import Faults, write_faults
from unbroken.bench.output import publish
from unbroken.config import executable_path
from unbroken.control.state.lease import EXIT_LEASE_STORE, LeaseFiles
from unbroken.launch.workers import free_port

FILESYSTEMS = ("ext4-128", "vfat", "tmp", "etcd")  # etcd: the lease in a real etcd, the state on tmp
TAKEOVER_TARGET_S = 2.0
DEFAULT_LEASE_S, DEFAULT_RENEW_S = 1.0, 0.25


def missing_tools(fs: str, fuse: bool) -> str | None:
    """Why this machine cannot run ``fs`` (None: it can)."""
    if fs == "etcd":
        fuse = False
        try:
            import etcd3gw  # noqa: F401
        except ImportError:
            return "missing etcd3gw (pip install 'unbroken[etcd]')"
    if os.geteuid() != 0 and (fs not in ("tmp", "etcd") or fuse):
        return "needs root (loop mounts and FUSE)"
    need = {
        "ext4-128": ["mkfs.ext4", "losetup"],
        "vfat": ["mkfs.vfat", "fusefat", "fusermount3"],
        "tmp": [],
        "etcd": ["etcd"],
    }[fs]
    if fuse:
        need.append("fusermount3")
    path = _admin_path()
    gone = [t for t in need if shutil.which(t, path=path) is None]
    if fuse:
        try:
            import mfusepy  # noqa: F401
        except (ImportError, OSError) as e:
            gone.append(f"mfusepy ({e})")
        if not os.path.exists("/dev/fuse"):
            gone.append("/dev/fuse")
    return f"missing {', '.join(gone)} (make lease-fs)" if gone else None


def _admin_path() -> str:
    """PATH with the administrators' folders, where mkfs and losetup live (a non-login PATH may lack them)."""
    return os.pathsep.join([executable_path(), "/usr/sbin", "/sbin"])


def _run(*cmd: str) -> None:
    env = {**os.environ, "PATH": _admin_path()}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=60)


class EtcdServer:
    """A real single-member etcd (Debian's etcd-server) on loopback, in ``work``: started,
    killed (SIGKILL), stopped (SIGSTOP) and restarted on the same data by the scenarios."""

    def __init__(self, work: Path) -> None:
        self.work, self.port, self.peer = work, free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}/bench"

    def start(self) -> None:
        c, p = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        argv = ["etcd", "--name", "bench", "--data-dir", str(self.work / "etcd-data"), "--listen-client-urls", c]
        argv += ["--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p]
        argv += ["--initial-cluster", f"bench={p}", "--log-level", "warn"]
        with open(self.work / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        from unbroken.control.state.lease_etcd import LeaseEtcd

        store = LeaseEtcd(self.url)
        wait_for(lambda: _answers(store), 30, "etcd to serve")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


def _answers(store: Any) -> bool:
    try:
        store.terms()
    except OSError:
        return False
    return True


@dataclasses.dataclass
class Where:
    """Where a scenario's coordinators keep their state and lease."""

    state: Path
    control: Path | None = None  # the faultfs control file (a FUSE layer)
    etcd: EtcdServer | None = None

    @property
    def args(self) -> list[str]:
        return ["--lease-store", self.etcd.url] if self.etcd is not None else []


@contextlib.contextmanager
def placed(fs: str, work: Path, fuse: bool) -> Iterator[Where]:
    """The state directory (and the lease's etcd) of a scenario on ``fs``; cleaned up after."""
    if fs != "etcd":
        with mounted(fs, work, fuse) as (state, control):
            yield Where(state, control)
        return
    etcd = EtcdServer(work)
    etcd.start()
    try:
        state = work / "state"
        state.mkdir()
        yield Where(state, None, etcd)
    finally:
        etcd.signal(signal.SIGCONT)
        etcd.kill()


@contextlib.contextmanager
def mounted(fs: str, work: Path, fuse: bool) -> Iterator[tuple[Path, Path | None]]:
    """A state directory on ``fs`` (and the faultfs control file, with ``fuse``); unmounted after."""
    base = work / f"{fs}-base"
    base.mkdir(parents=True, exist_ok=True)
    image = work / f"{fs}.img"
    mounts: list[Path] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if fs != "tmp":
            with open(image, "wb") as f:
                f.truncate(64 << 20)
            _run(*(("mkfs.ext4", "-q", "-F", "-I", "128") if fs == "ext4-128" else ("mkfs.vfat",)), str(image))
            if fs == "vfat":
                _run("fusefat", "-o", "rw+", str(image), str(base))
            else:
                _run("mount", "-o", "loop", str(image), str(base))
            mounts.append(base)
        top, control = base, None
        if fuse:
            top, control = work / f"{fs}-fuse", work / f"{fs}-faults.json"
            top.mkdir(exist_ok=True)
            write_faults(control, Faults())
            log = open(work / f"{fs}-faultfs.log", "wb")  # noqa: SIM115: the daemon's, closed below
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "unbroken.bench.control_plane.faultfs", str(base), str(top), str(control)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
            deadline = time.monotonic() + 15
            while not os.path.ismount(top):
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"faultfs did not mount: {(work / f'{fs}-faultfs.log').read_text()[-500:]}")
                time.sleep(0.05)
            mounts.insert(0, top)
        state = top / "state"
        state.mkdir()
        yield state, control
    finally:
        for m in mounts:
            fuse_mount = m.name.endswith("-fuse") or fs == "vfat"
            with contextlib.suppress(Exception):
                _run(*(("fusermount3", "-u") if fuse_mount else ("umount",)), str(m))
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            if p.poll() is None:
                p.kill()
                p.wait()
        image.unlink(missing_ok=True)


@dataclasses.dataclass
class Pair:
    """An active coordinator and its standby on one state directory."""

    active: subprocess.Popen[bytes]
    standby: subprocess.Popen[bytes]
    active_log: Path
    standby_log: Path
    ports: tuple[int, int]

    def said(self, which: str, text: str) -> bool:
        log = self.active_log if which == "active" else self.standby_log
        return text in log.read_text(errors="replace")

    def stop(self) -> None:
        for p in (self.active, self.standby):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
        for p in (self.active, self.standby):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_pair(where: Where, work: Path, lease_s: float = DEFAULT_LEASE_S, renew_s: float = DEFAULT_RENEW_S) -> Pair:
    """Starts the active coordinator, waits for its lease, then starts the standby."""
    ports = (free_port(), free_port())
    common = ["--replicas", "2", "--min-replicas", "1", "--state-dir", str(where.state), "--lease", str(lease_s)]
    common += ["--lease-renew", str(renew_s), "--host", "127.0.0.1", *where.args]
    logs = (work / "active.log", work / "standby.log")
    procs = []
    for i, extra in enumerate(([], ["--standby"])):
        with open(logs[i], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "unbroken", "coordinator", "--port", str(ports[i]), *common, *extra],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        if i == 0:
            wait_for(lambda: "coordinator listening" in logs[0].read_text(errors="replace"), 30, "the active to listen")
    pair = Pair(procs[0], procs[1], logs[0], logs[1], ports)
    wait_for(lambda: pair.said("standby", "standby: waiting"), 30, "the standby to wait")
    return pair


def wait_for(cond: Any, timeout: float, what: str) -> float:
    """Polls ``cond`` until true; returns when (monotonic). TimeoutError with ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(0.01)
    raise TimeoutError(f"waited {timeout}s for {what}")


def answers_status(port: int, state: Path, timeout: float) -> float | None:
    """When (monotonic) the coordinator on ``port`` answered a status request; None by ``timeout``."""
    from unbroken.control import protocol
    from unbroken.control.state import secret_file as secrets

    secret, _ = secrets.kept(state)

    async def ask() -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reader, writer, session = await asyncio.wait_for(protocol.connect_async("127.0.0.1", port, secret), 1.0)
                link = protocol.Link(reader, writer, session)
                link.send(protocol.StatusRequest().to_msg())
                line = await asyncio.wait_for(link.readline(), 1.0)
                writer.close()
                if line is not None and link.decode(line).get("op") == "status":
                    return time.monotonic()
            except (OSError, asyncio.TimeoutError, TimeoutError, EOFError, ValueError):
                pass
            await asyncio.sleep(0.02)
        return None

    return asyncio.run(ask())


def _store(where: Where) -> Any:
    if where.etcd is not None:
        from unbroken.control.state.lease_etcd import LeaseEtcd

        return LeaseEtcd(where.etcd.url)
    return LeaseFiles(where.state)


def live(fs: str, work: Path, *, renewals: int, delay_s: float) -> dict[str, Any]:
    """A live holder for ``renewals`` renewal periods (takeovers must be 0), then SIGSTOP."""
    with placed(fs, work, fuse=delay_s > 0 and fs != "etcd") as where:
        state = where.state
        if where.control is not None:
            write_faults(where.control, Faults(delay_s=delay_s))
        pair = start_pair(where, work)
        try:
            time.sleep(renewals * DEFAULT_RENEW_S)
            takeovers = int(pair.said("standby", "taking over")) + int(pair.active.poll() is not None)
            newest = _store(where).newest()
            seq = newest.seq if newest is not None else None
            stopped = time.monotonic()
            os.kill(pair.active.pid, signal.SIGSTOP)
            answered = answers_status(pair.ports[1], state, 15.0)
            os.kill(pair.active.pid, signal.SIGCONT)
            code = pair.active.wait(15)
        finally:
            pair.stop()
        return {
            "filesystem": fs,
            "delay_ms": delay_s * 1000,
            "renewals": renewals,
            "holder_renewals_seen": seq,
            "takeovers_of_a_live_holder": takeovers,
            "sigstop_to_standby_answer_s": None if answered is None else round(answered - stopped, 3),
            "woken_holder_exit": code,
        }


def store_fails(fs: str, work: Path, etcd_down_s: float = 3.0) -> dict[str, Any]:
    """The active's lease calls fail with EIO from an instant on (on etcd: the server is killed,
    and started again ``etcd_down_s`` later, when the standby may take over)."""
    with placed(fs, work, fuse=True) as where:
        state = where.state
        pair = start_pair(where, work)
        try:
            time.sleep(2.0)
            failed = time.monotonic()
            if where.etcd is not None:
                where.etcd.kill()
            else:
                assert where.control is not None
                # Every call of the active's on the store (its lease and its state), not its standby's.
                write_faults(where.control, Faults(errno="EIO", pids=(pair.active.pid,)))
            try:
                code = pair.active.wait(15)
            except subprocess.TimeoutExpired:
                code = None
            exited = time.monotonic()
            if where.etcd is not None:
                time.sleep(max(0.0, etcd_down_s - (exited - failed)))
                where.etcd.start()
            answered = answers_status(pair.ports[1], state, 15.0)
        finally:
            pair.stop()
        return {
            "filesystem": fs,
            "exit_code": code,
            "exit_code_expected": EXIT_LEASE_STORE,
            "failure_to_exit_s": round(exited - failed, 3),
            "failure_to_standby_answer_s": None if answered is None else round(answered - failed, 3),
            **({"etcd_down_s": etcd_down_s} if where.etcd is not None else {}),
        }


def stall(fs: str, work: Path, stall_s: float = 0.5) -> dict[str, Any]:
    """Members heartbeat through a stall of every call of the store: none may be dropped or evicted."""
    from unbroken.control import protocol
    from unbroken.control.state import secret_file as secrets

    with placed(fs, work, fuse=True) as where:
        state, control, etcd = where.state, where.control, where.etcd
        pair = start_pair(where, work)
        secret, _ = secrets.kept(state)

        async def members() -> dict[str, Any]:
            links = []
            for replica in (0, 1):
                reader, writer, session = await protocol.connect_async("127.0.0.1", pair.ports[0], secret)
                link = protocol.Link(reader, writer, session)
                link.send({"op": "hello", "replica": replica, "rank": 0, "world_size": 1, "transfer_addr": ""})
                links.append(link)
            dropped = [0]

            async def beat(link: protocol.Link) -> None:
                while True:
                    link.send(protocol.Heartbeat(step=0, compute_s=None).to_msg())
                    await asyncio.sleep(0.1)

            async def read(link: protocol.Link) -> None:
                if await link.readline() is None:
                    dropped[0] += 1
                    return
                while await link.readline() is not None:
                    pass
                dropped[0] += 1

            tasks = [asyncio.ensure_future(f(link)) for link in links for f in (beat, read)]
            await asyncio.sleep(2.0)
            if etcd is not None:  # the lease's store stops answering: etcd stopped, not killed
                etcd.signal(signal.SIGSTOP)
                await asyncio.sleep(stall_s)
                etcd.signal(signal.SIGCONT)
            else:
                assert control is not None
                write_faults(control, Faults(stall_until=time.time() + stall_s))
            await asyncio.sleep(stall_s + 3.0)
            for t in tasks:
                t.cancel()
            ended = time.time()  # the members leave: what follows is not the stall's
            for link in links:
                link.writer.close()
            return {"connections_dropped": dropped[0], "ended": ended}

        try:
            got = asyncio.run(members())
            ended = got.pop("ended")
            time.sleep(0.5)
        finally:
            pair.stop()
        events = [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines() if line.strip()]
        return {
            "filesystem": fs,
            "stall_s": stall_s,
            **got,
            "replicas_evicted": len([e for e in events if e.get("kind") == "replica_evicted" and e["t"] < ended]),
            "took_over": pair.said("standby", "taking over"),
        }


def terms_out_of_order(answers: list[tuple[float, int | None]]) -> int:
    """How many answers came from an older term than one answered before them (all clients'
    answers in the order they arrived): each is an instant two coordinators answered."""
    newest, bad = -1, 0
    for _, term in sorted(answers, key=lambda a: a[0]):
        t = -1 if term is None else term
        if t < newest:
            bad += 1
        newest = max(newest, t)
    return bad


def forced_takeovers(fs: str, work: Path, takeovers: int, replicas: int = 2) -> dict[str, Any]:
    """``takeovers`` times: the active is stopped (SIGSTOP) until its standby takes over, then
    woken (it must step down) and restarted as the new standby. Meanwhile ``replicas`` real
    clients ask a quorum per step through both addresses; every answer's term is recorded."""
    import threading

    from unbroken.control.client import CoordinatorClient
    from unbroken.control.state import secret_file as secrets

    with placed(fs, work, fuse=False) as where:
        pair = start_pair(where, work)
        secret, _ = secrets.kept(where.state)
        addresses = ",".join(f"127.0.0.1:{p}" for p in pair.ports)
        answers: list[tuple[float, int | None]] = []
        per_client: list[list[int | None]] = [[] for _ in range(replicas)]
        done = threading.Event()
        errors: list[str] = []

        def ask(replica: int) -> None:
            hello = {"replica": replica, "rank": 0, "world_size": 1, "transfer_addr": ""}
            client = CoordinatorClient(addresses, secret, hello, heartbeat_s=0.1, reconnect_timeout_s=60)
            step = 0
            try:
                while not done.is_set():
                    got = client.request_quorum(step).result(timeout=60)
                    answers.append((time.monotonic(), got.get("term")))
                    per_client[replica].append(got.get("term"))
                    step = int(got["decision"]["step"]) + 1
                    time.sleep(0.02)
            except Exception as e:  # a client that stops answering is the scenario's failure
                errors.append(f"replica {replica}: {type(e).__name__}: {e}")
            finally:
                client.close(finished=False)

        threads = [threading.Thread(target=ask, args=(r,), daemon=True) for r in range(replicas)]
        for t in threads:
            t.start()
        takeover_s, stepped_down, procs = [], 0, []
        active, standby = pair.active, pair.standby
        ports = list(pair.ports)
        try:
            for i in range(takeovers):
                time.sleep(1.0)
                t0 = time.monotonic()
                os.kill(active.pid, signal.SIGSTOP)
                answered = answers_status(ports[1], where.state, 15.0)
                takeover_s.append(None if answered is None else answered - t0)
                os.kill(active.pid, signal.SIGCONT)
                stepped_down += int(active.wait(15) == 75)
                log = work / f"standby-{i}.log"
                common = ["--replicas", str(replicas), "--min-replicas", "1", "--state-dir", str(where.state)]
                common += ["--host", "127.0.0.1", *where.args, "--port", str(ports[0]), "--standby"]
                with open(log, "wb") as f:
                    fresh = subprocess.Popen(
                        [sys.executable, "-m", "unbroken", "coordinator", *common], stdout=f, stderr=subprocess.STDOUT
                    )
                procs.append(fresh)
                wait_for(lambda log=log: "standby: waiting" in log.read_text(errors="replace"), 30, "a new standby")
                active, standby = standby, fresh
                ports.reverse()
            time.sleep(1.0)
        finally:
            done.set()
            for t in threads:
                t.join(70)
            for p in (active, standby, *procs):
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(15)
                if p.poll() is None:
                    p.kill()
                    p.wait()
            pair.stop()
        ok = sorted(s for s in takeover_s if s is not None)
        return {
            "filesystem": fs,
            "takeovers": takeovers,
            "answers": len(answers),
            "answers_of_an_older_term": terms_out_of_order(answers),
            "clients_terms_in_order": all(
                [t or 0 for t in terms] == sorted(t or 0 for t in terms) for terms in per_client
            ),
            "stepped_down": stepped_down,
            "takeover_s_p50": round(ok[len(ok) // 2], 3) if ok else None,
            "takeover_s_max": round(ok[-1], 3) if ok else None,
            "missed_takeovers": len(takeover_s) - len(ok),
            "terms_answered_in": sorted({t for _, t in answers if t is not None}),
            "client_errors": errors[:5],
        }


@click.command("lease")
@click.option("--filesystem", "filesystems", multiple=True, type=click.Choice(FILESYSTEMS), default=FILESYSTEMS)
@click.option("--renewals", default=200, show_default=True, help="How long the live holder runs, in renewals.")
@click.option("--delay-ms", default=5.0, show_default=True, help="Latency added to every call (FUSE).")
@click.option("--takeovers", default=100, show_default=True, help="Forced takeovers per store (0: none).")
@click.option("--work-dir", type=click.Path(path_type=Path), default=None, help="Default: a temporary directory.")
@click.option("--out", default="runs/bench/lease.json", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def lease(
    filesystems: tuple[str, ...],
    renewals: int,
    delay_ms: float,
    takeovers: int,
    work_dir: Path | None,
    out: str,
    as_json: bool,
) -> None:
    """The lease on real filesystems: no takeover of a live holder, exits on store failures, stalls."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-lease-") as tmp:
        work = work_dir or Path(tmp)
        for fs in filesystems:
            scenarios: list[tuple[str, bool, Callable[[Path], dict[str, Any]]]] = [
                ("live", False, functools.partial(live, fs, renewals=renewals, delay_s=0.0)),
                ("live_slow", True, functools.partial(live, fs, renewals=renewals, delay_s=delay_ms / 1000)),
                ("store_fails", True, functools.partial(store_fails, fs)),
                ("stall", True, functools.partial(stall, fs)),
            ]
            if takeovers:
                scenarios.append(
                    ("forced_takeovers", False, functools.partial(forced_takeovers, fs, takeovers=takeovers))
                )
            for name, fuse, run in scenarios:
                why = missing_tools(fs, fuse)
                if fs == "etcd" and name == "live_slow":
                    why = "no latency layer for etcd's network here (its stall is in `stall`)"
                if why is not None:
                    rows.append({"scenario": name, "filesystem": fs, "skipped": why})
                    continue
                w = work / f"{name}-{fs}"
                shutil.rmtree(w, ignore_errors=True)
                w.mkdir(parents=True)
                row = {"scenario": name, **run(w)}
                rows.append(row)
                if not as_json:
                    click.echo(json.dumps(row))
    result = {"takeover_target_s": TAKEOVER_TARGET_S, "scenarios": rows}
    publish(result, out, as_json)
