"""A 2-rank FSDP2 job saves through unbroken's DCPWriter (dcp.save and dcp.async_save); this test
process, one rank with no process group and no unbroken reader, loads each step with plain
``torch.distributed.checkpoint.load`` into an unsharded model and gets the job's state bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.integration.harness import run_ranks
from tests.integration.workers.dcp_fsdp import assert_equal, build

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]
WORKER = Path(__file__).parent / "workers" / "dcp_fsdp.py"


def test_fsdp2_checkpoint_saved_through_unbroken_loads_with_plain_dcp_at_one_rank(tmp_path: Path) -> None:
    codes, logs = run_ranks(WORKER, tmp_path)
    assert codes == [0, 0], logs
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000003"

    for step in (2, 3):
        model = build(7)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=tmp_path / "ckpt" / f"step-{step:08d}")  # FileSystemReader
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_sd, optim_sd = get_state_dict(model, opt)
        assert_equal({"model": model_sd, "optim": optim_sd}, torch.load(tmp_path / f"full-{step}.pt"), f"step {step}")
