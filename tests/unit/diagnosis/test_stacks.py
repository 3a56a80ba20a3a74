"""A hung rank's stack comes from the process that started it, never from a PID a connection named."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.live_coordinator import live_coordinator, member
from unbroken.diagnosis import stacks
from unbroken.diagnosis.verdict import NONCOMM_HANG, Culprit, Verdict
from unbroken.wire.auth import JobSecret

ROOT = Path(__file__).resolve().parents[3]


def test_the_owner_dumps_its_own_childs_stack(tmp_path: Path) -> None:
    path = stacks.stack_path(tmp_path, 2, 0)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import signal, time
        from unbroken.diagnosis.stack_dump import install_stack_dump
        install_stack_dump({path!r}, signal.SIGUSR2)
        print("ready", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        extra = asyncio.run(stacks.dump(child.pid, path, signal.SIGUSR2, wait_s=10))
        assert extra["process_state"] in ("S", "R") and "most recent call first" in (extra["stack"] or "")
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        extra = asyncio.run(stacks.dump(child.pid, path, signal.SIGUSR2))
        assert extra["process_state"] == "T" and extra["stack"] is None and "SIGSTOP" in extra["stack_note"]
    finally:
        child.kill()
        child.wait()


async def _hello_with_a_pid_and_a_path(state_dir: Path, victim: int, secret_path: Path) -> dict[str, object]:
    secret = JobSecret.generate()
    async with live_coordinator(state_dir, secret, total_replicas=2) as c:
        # What the audit did: a hello naming another process and a file the coordinator can read.
        link = await member(c, secret, replica=1, pid=victim, stack_file=str(secret_path), stack_signal=15)
        try:
            await c.diagnosis._with_stack(Verdict(Culprit(1, 0, ""), NONCOMM_HANG, 0.9, {}))  # as for a hang
            return c.diagnosis.latest[-1]["evidence"]
        finally:
            link.close()


def test_the_coordinator_signals_no_pid_and_reads_no_path_from_a_hello(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "30"])
    secret_path = tmp_path / "private.txt"
    secret_path.write_text("PRIVATE-CONTENT\n" * 10)
    try:
        evidence = asyncio.run(_hello_with_a_pid_and_a_path(tmp_path / "state", victim.pid, secret_path))
        time.sleep(0.1)
        assert victim.poll() is None, "the coordinator signalled a PID named in a hello"
        assert "PRIVATE-CONTENT" not in str(evidence)
        assert "PRIVATE-CONTENT" not in (tmp_path / "state" / "events.jsonl").read_text()
    finally:
        victim.kill()
        victim.wait()
