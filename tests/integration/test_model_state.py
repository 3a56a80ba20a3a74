"""unbroken.model_state on a real 2-rank FSDP2 model: its DTensor state goes through the peer
transfer and a checkpoint with no hand-made shards, and loads back bitwise (see the worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WORKER = Path(__file__).parent / "workers" / "model_state_check.py"


def test_fsdp2_state_round_trips_through_a_peer_and_a_checkpoint(tmp_path: Path) -> None:
    codes, logs = run_ranks(WORKER, tmp_path)
    assert codes == [0, 0], logs
    for rank in (0, 1):
        assert json.loads((tmp_path / f"ok-rank{rank}.json").read_text()) == ["transfer", "checkpoint", "trains on"]
