"""One rank of a 2-rank FSDP2 job (plain torch.distributed) that checkpoints through
``unbroken.checkpoint.DCPWriter`` with ``dcp.save`` (step 2) and ``dcp.async_save`` (step 3, while
training goes on), and loads step 2 back into a fresh FSDP2 model through ``DCPReader``.

Rank 0 writes the full (unsharded) state of each saved step to ``--out/full-{step}.pt``, the
reference the test compares a 1-rank plain ``dcp.load`` against. Exits 0 when the reloaded
model's state equals the saved one bitwise; writes ``ok-rank{K}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from unbroken import fast_exit
from unbroken.checkpoint import DCPReader, DCPWriter


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 12 and 5 rows over 2 ranks: one even and one uneven shard.
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    opt.step()


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a DCP user saves: DTensors from get_state_dict, no hand-made shard markers."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd}


def save_reference(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Every rank gathers, rank 0 writes, at once: the optimizer's step counts in a full state
    dict are its live tensors, not copies."""
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, path)


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs: {a} vs {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where} keys differ"
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    saver_pg = dist.new_group(backend="gloo")  # async_save's collectives, apart from training's
    root = args.out / "ckpt"

    model = fully_shard(build(0), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        train_step(model, opt, step)
    dcp.save(dcp_state(model, opt), storage_writer=DCPWriter(root, step=2))
    save_reference(model, opt, args.out / "full-2.pt")

    train_step(model, opt, 2)
    save_reference(model, opt, args.out / "full-3.pt")
    saving = dcp.async_save(dcp_state(model, opt), storage_writer=DCPWriter(root, step=3), process_group=saver_pg)
    train_step(model, opt, 3)  # training goes on while step 3 is written from its staged copy
    saving.result()

    fresh = fully_shard(build(1), mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    state = dcp_state(fresh, fresh_opt)
    dcp.load(state, storage_reader=DCPReader(root / "step-00000002"))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_state(fresh, fresh_opt)
    if rank == 0:
        assert_equal(loaded, torch.load(args.out / "full-2.pt"), "reloaded step 2")
    (args.out / f"ok-rank{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    fast_exit.install()
    main()
