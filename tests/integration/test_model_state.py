"""unbroken.model_state on a real 2-rank FSDP2 model: its DTensor state goes through the peer
transfer and a checkpoint with no hand-made shards, and loads back bitwise (see the worker)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import python_env
from unbroken.launch.workers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WORKER = Path(__file__).parent / "workers" / "model_state_check.py"


def test_fsdp2_state_round_trips_through_a_peer_and_a_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {
                **python_env(),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), "--out", str(tmp_path)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [0, 0], logs
    for rank in (0, 1):
        assert json.loads((tmp_path / f"ok-rank{rank}.json").read_text()) == ["transfer", "checkpoint", "trains on"]
