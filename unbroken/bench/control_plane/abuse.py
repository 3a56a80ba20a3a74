"""``unbroken bench abuse``: a stranger floods every listener of a job while a replica recovers.

Two runs of the same small job (the example GPT under ``unbroken run``, in this process, with
``/metrics`` served): ``unloaded``, then ``flood``. In each, once every replica trains, one
replica is killed (``kill -9``) and the time until it is a full member of the quorum again is
its recovery. In the ``flood`` run a separate process (:mod:`unbroken.bench.control_plane.abuse_flood`)
first holds, on every listener (the coordinator, the job's store, each replica's catch-up
port, the dashboard's HTTP server, and a peer checkpoint store started beside the job), a
number of connections that never authenticate, idle or dripping a byte a second, reopens the
ones each listener sheds, and fuzzes each with wrong tickets and garbage; meanwhile it
connects to each listener as the job's own processes do, and counts the connects that fail.

The JSON holds, per run: the recovery's seconds; per listener the connections the flood held
(at most, and at the end), how many the listener shed, the legitimate connects made and
refused and their latency; and the threads, descriptors and resident memory of each server
process (the launcher, which hosts the coordinator, the store and the HTTP server; each
replica; the peer store) before the flood and while it is on. ``recovery_ratio`` is the
flooded recovery over the unloaded one (the target: at most 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.config import ENV_SECRET_FILE
from unbroken.launch.run.launcher import Launcher, LaunchSettings
from unbroken.launch.workers import package_path
from unbroken.observe.events import read_jsonl
from unbroken.observe.http import read_token

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "examples" / "gpt" / "train.py"


@dataclasses.dataclass(frozen=True)
class AbuseSettings:
    replicas: int = 3
    steps: int = 100_000  # the run is stopped once the recovery is measured
    pace_s: float = 0.12
    idle: int = 512  # unauthenticated connections held idle per listener
    drip: int = 64  # and dripping a byte a second
    reopen_per_round: int = 32  # a listener's shed connections reopened per 0.1 s, per kind
    probe_every_s: float = 0.25  # a legitimate connect to each listener this often
    warm_step: int = 10  # every replica trained this far before anything starts
    flood_warmup_s: float = 5.0  # the flood builds up this long before the kill
    hold_s: float = 10.0  # and goes on this long after the recovery (more legitimate connects)
    recovery_timeout_s: float = 180.0
    victim: int = 1

    @classmethod
    def quick(cls) -> AbuseSettings:
        return cls(idle=200, drip=20, flood_warmup_s=3.0, hold_s=3.0, recovery_timeout_s=120.0)


def recovery_s(events: list[dict[str, Any]], victim: int, kill_t: float) -> float | None:
    """Seconds from the kill to the victim training again as a full member (the launcher's
    ``replica_state`` event: restarted, caught up from a donor, back in the quorum)."""
    for e in events:
        if e.get("kind") == "replica_state" and e.get("replica") == victim and e["t"] > kill_t:
            if e.get("new") == "training":
                return float(e["t"] - kill_t)
    return None


def process_figures(pid: int) -> dict[str, Any]:
    """Threads, open descriptors and resident MiB of a live process (from /proc)."""
    out: dict[str, Any] = {"pid": pid}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        for line in status.splitlines():
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        out["gone"] = True
    return out


def _pids(run_dir: Path, replicas: int) -> dict[int, int]:
    started = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "process_started"]
    return {
        r: [e["pid"] for e in started if e["replica"] == r][-1]
        for r in range(replicas)
        if any(e["replica"] == r for e in started)
    }


def _steps(run_dir: Path, replica: int) -> int:
    path = run_dir / f"metrics-r{replica}.jsonl"
    if not path.exists():
        return -1
    steps = [row["step"] for row in read_jsonl(path) if "step" in row]
    return steps[-1] if steps else -1


class _Scenario:
    """One run: waits for training, floods (or not), kills the victim, times its recovery."""

    def __init__(self, s: AbuseSettings, run_dir: Path, flood: bool, log: Any) -> None:
        self.s, self.run_dir, self.flood, self.log = s, run_dir, flood, log
        self.result: dict[str, Any] = {"flood": flood}
        self._flooder: subprocess.Popen[bytes] | None = None

    async def run(self, launcher: Launcher, peer_address: str, peer_pid: int) -> None:
        try:
            await self._run(launcher, peer_address, peer_pid)
        except Exception as e:  # the figure is the failure; the run still ends cleanly
            self.result["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            self.result["flooder"] = await asyncio.to_thread(self._stop_flooder)
            launcher.stop()

    async def _run(self, launcher: Launcher, peer_address: str, peer_pid: int) -> None:
        s = self.s
        deadline = time.monotonic() + 300
        while min(_steps(self.run_dir, r) for r in range(s.replicas)) < s.warm_step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas did not all reach step {s.warm_step} in 300 s")
            await asyncio.sleep(0.2)
        coordinator = launcher.coordinator
        assert coordinator is not None and launcher.http is not None
        targets = [
            {"name": "coordinator", "address": coordinator.address, "kind": "ticket", "purpose": "coordinator"},
            {"name": "store", "address": coordinator.store_address, "kind": "ticket", "purpose": "store"},
            {"name": "http", "address": launcher.http.address, "kind": "http"},
            {"name": "peer_store", "address": peer_address, "kind": "peer"},
        ]
        for r, ranks in sorted(coordinator.replicas.items()):
            if r == s.victim:
                continue  # its port dies with it: the survivors' are the donors that matter
            for rank, conn in sorted(ranks.items()):
                targets.append(
                    {
                        "name": f"catchup_r{r}_{rank}",
                        "address": conn.transfer_addr,
                        "kind": "ticket",
                        "purpose": "transfer",
                    }
                )
        pids = _pids(self.run_dir, s.replicas)
        servers = {
            "launcher": os.getpid(),  # the coordinator, the store and the HTTP server
            "peer_store": peer_pid,
            **{f"replica{r}": pid for r, pid in pids.items() if r != s.victim},
        }
        self.result["before"] = {k: process_figures(p) for k, p in servers.items()}
        if self.flood:
            self._start_flooder(launcher, targets)
            await asyncio.sleep(s.flood_warmup_s)
        self.result["under_flood" if self.flood else "unloaded"] = {k: process_figures(p) for k, p in servers.items()}
        kill_t = time.time()
        os.kill(pids[s.victim], signal.SIGKILL)
        self.log(f"killed replica {s.victim} (pid {pids[s.victim]})")
        deadline = time.monotonic() + s.recovery_timeout_s
        while (rec := recovery_s(list(read_jsonl(self.run_dir / "events.jsonl")), s.victim, kill_t)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {s.victim} did not recover in {s.recovery_timeout_s} s")
            await asyncio.sleep(0.2)
        self.result["recovery_s"] = round(rec, 3)
        self.log(f"recovered in {rec:.2f} s")
        if self.flood:
            await asyncio.sleep(s.hold_s)
        self.result["after_recovery"] = {k: process_figures(p) for k, p in servers.items()}

    def _start_flooder(self, launcher: Launcher, targets: list[dict[str, Any]]) -> None:
        s = self.s
        spec = {
            "secret_file": str(launcher.secret_file),
            "token": read_token(launcher.secret.key),
            "targets": targets,
            "idle": s.idle,
            "drip": s.drip,
            "reopen_per_round": s.reopen_per_round,
            "probe_every_s": s.probe_every_s,
            "seconds": s.recovery_timeout_s + s.flood_warmup_s + s.hold_s + 60,
        }
        path = self.run_dir / "flood-spec.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, **package_path()}
        self._flooder = subprocess.Popen(
            [sys.executable, "-m", "unbroken.bench.control_plane.abuse_flood", str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(self.run_dir / "flooder.log", "wb"),  # noqa: SIM115 (the child holds it)
        )
        self.result["flooder_pid"] = self._flooder.pid

    def _stop_flooder(self) -> dict[str, Any] | None:
        if self._flooder is None:
            return None
        proc, self._flooder = self._flooder, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": "the flooder did not stop in 60 s"}
        try:
            return dict(json.loads(out.decode().strip().splitlines()[-1]))
        except (ValueError, IndexError):
            return {"error": f"no figures from the flooder (exit code {proc.returncode})"}


def _start_peer_store(secret_file: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, **package_path(), ENV_SECRET_FILE: str(secret_file)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken.checkpoint.peer"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(log_path, "wb"),  # noqa: SIM115 (the child holds it)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.isdigit():
        proc.kill()
        proc.wait()
        raise click.ClickException(f"the peer store did not start (see {log_path})")
    return proc, f"127.0.0.1:{line}"


def run_once(s: AbuseSettings, run_dir: Path, flood: bool, log: Any) -> dict[str, Any]:
    """One job, one kill: recovery time and the servers' figures (and the flood's, if ``flood``)."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    settings = LaunchSettings(
        command=(sys.executable, str(TRAIN), "--steps", str(s.steps), "--pace-s", str(s.pace_s)),
        replicas=s.replicas,
        run_dir=run_dir,
        http_port=0,
    )
    launcher = Launcher(settings)
    peer, peer_address = _start_peer_store(launcher.secret_file, run_dir / "peer-store.log")
    scenario = _Scenario(s, run_dir, flood, log)
    try:

        async def go() -> int:
            task = asyncio.create_task(scenario.run(launcher, peer_address, peer.pid))
            code = await launcher.run()
            if not task.done():  # the job ended first (it failed): the scenario's figures stop here
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return code

        scenario.result["exit_code"] = asyncio.run(go())
    finally:
        peer.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            peer.wait(10)
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    return scenario.result


def summary(unloaded: dict[str, Any], flooded: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: legitimate connects refused (all listeners), the recovery ratio."""
    targets = (flooded.get("flooder") or {}).get("targets", {})
    refused = sum(t.get("legit_refused", 0) for t in targets.values())
    made = sum(t.get("legit_ok", 0) + t.get("legit_refused", 0) for t in targets.values())
    base, under = unloaded.get("recovery_s"), flooded.get("recovery_s")
    return {
        "legit_connects": made,
        "legit_refused": refused,
        "held_max": {name: t.get("held_max") for name, t in targets.items()},
        "recovery_unloaded_s": base,
        "recovery_flood_s": under,
        "recovery_ratio": round(under / base, 3) if base and under else None,
    }


@click.command()
@click.option("--quick", is_flag=True, help="Fewer flooding connections (the test suite's form).")
@click.option("--idle", type=click.IntRange(0, 10_000), default=None, help="Idle connections held per listener.")
@click.option("--drip", type=click.IntRange(0, 10_000), default=None, help="Dripping connections held per listener.")
@click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/bench/abuse-run"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/abuse.json"), show_default=True)
def abuse(quick: bool, idle: int | None, drip: int | None, run_dir: Path, as_json: bool, out: Path) -> None:
    """Flood every listener of a job with unauthenticated connections while a replica recovers."""
    s = AbuseSettings.quick() if quick else AbuseSettings()
    s = dataclasses.replace(s, idle=s.idle if idle is None else idle, drip=s.drip if drip is None else drip)

    def log(msg: str) -> None:
        click.echo(f"[abuse] {msg}", err=True)

    log(f"unloaded run ({s.replicas} replicas)")
    unloaded = run_once(s, run_dir / "unloaded", False, log)
    log(f"flooded run ({s.idle} idle + {s.drip} dripping connections per listener)")
    flooded = run_once(s, run_dir / "flood", True, log)
    result = {
        "settings": dataclasses.asdict(s),
        "load": os.getloadavg(),
        "unloaded": unloaded,
        "flood": flooded,
        "summary": summary(unloaded, flooded),
    }
    publish(result, out, as_json)
