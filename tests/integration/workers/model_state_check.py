"""One rank of a 2-rank FSDP2 job (plain torch.distributed, no unbroken job) that moves its
``unbroken.model_state`` through both paths a replica's state takes: a peer transfer (as local
shards) and a checkpoint (as Shards), each loaded into a differently initialised copy.

Exits 0 when every loaded copy equals the original bitwise and then trains identically;
writes ``ok-rank{K}.json`` into ``--out`` with what it checked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken
from unbroken import fast_exit
from unbroken.comm.catchup import CatchupServer, SnapshotCopy, fetch_state
from unbroken.train.state import as_local, as_shards
from unbroken.wire.auth import JobSecret


def build(seed: int, mesh: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    model = fully_shard(net, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    opt.step()


def same(a: unbroken.ModelState, b: unbroken.ModelState) -> None:
    sa, sb = as_local(a.state_dict()), as_local(b.state_dict())
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), f"parameter {k} differs"
    assert sa["optim"]["state"].keys() == sb["optim"]["state"].keys()
    for fqn, st in sa["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optim"]["state"][fqn][k]), f"optimizer {fqn}.{k} differs"
    assert sa["optim"]["param_groups"] == sb["optim"]["param_groups"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    model, opt = build(0, mesh)
    for step in range(3):
        train_step(model, opt, step)
    original = unbroken.model_state(model, opt)
    checked = []

    # A peer: the state as local shards, over the real transfer, into a fresh copy.
    secret = JobSecret.generate()
    server = CatchupServer(secret)
    try:
        SnapshotCopy(7, as_local({"train": original.state_dict()}), server.pool, server.publish).wait()
        fetched = fetch_state(server.address, 7, secret)
    finally:
        server.close()
    peer_model, peer_opt = build(1, mesh)
    peer = unbroken.model_state(peer_model, peer_opt)
    # As in a catch-up: loaded after this step's backward pass, before the optimizer ever stepped.
    peer_model(torch.randn(4, 8)).sum().backward()
    peer.load_state_dict(fetched["train"])
    same(original, peer)
    checked.append("transfer")

    # A checkpoint: DTensors stored as Shards, loaded into another fresh copy.
    with unbroken.Checkpointer(str(args.out / "ckpt"), rank=rank, world_size=dist.get_world_size()) as ck:
        ck.save(7, as_shards({"train": original.state_dict()}))
        assert all(o.ok for o in ck.wait())
        ck_model, ck_opt = build(2, mesh)
        restored = unbroken.model_state(ck_model, ck_opt)
        restored.load_state_dict(ck.load(7).state["train"])
    same(original, restored)
    checked.append("checkpoint")

    # Loaded copies are real FSDP2 state: they train on exactly like the original.
    for m, o in ((model, opt), (peer_model, peer_opt), (ck_model, ck_opt)):
        train_step(m, o, 3)
    same(original, peer)
    same(original, restored)
    checked.append("trains on")
    (args.out / f"ok-rank{rank}.json").write_text(json.dumps(checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    fast_exit.install()
    main()
