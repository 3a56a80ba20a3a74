"""Several torchft Managers in one process, as torchft's own integration tests run replicas:
threads that reach a lighthouse of this process (``unbroken.torchft.lighthouse``, an unbroken
coordinator on a thread). Each replica seeds its model differently; ``init_sync`` and the
exchange leave them identical, and a replica that leaves and rejoins catches up."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn, optim

from unbroken.torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from unbroken.torchft.lighthouse import LighthouseServer

pytestmark = pytest.mark.integration


def train(
    lighthouse: str, replica: int, steps: int, leave_at: int | None, seeds: threading.Lock, copies: bool = False
) -> dict[str, Any]:
    with seeds:
        torch.manual_seed(replica)  # different on each replica: init_sync makes them equal
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inner = optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        sd = model.state_dict()  # copies: as torchtitan's fused QKV splits its weight in state_dict()
        return {"model": {k: v.clone() for k, v in sd.items()} if copies else sd, "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=str(replica),
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
    )
    try:
        net = DistributedDataParallel(manager, model)
        opt = Optimizer(manager, inner)
        g = torch.Generator().manual_seed(10 + replica)
        for _ in range(4 * steps):  # bounded: failed steps are redone
            if manager.current_step() >= steps:
                break
            opt.zero_grad()
            net(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
            opt.step()
            if leave_at is not None and manager.current_step() == leave_at:
                raise RuntimeError("leaves")  # a crash of this replica's thread
        return {"step": manager.current_step(), **state_dict()}
    finally:
        manager.shutdown(wait=False)


def run(leave: bool, copies: bool = False) -> list[dict[str, Any]]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    seeds = threading.Lock()
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:

            def replica(r: int) -> dict[str, Any]:
                if leave and r == 1:
                    try:
                        train(lighthouse.address(), r, 6, 2, seeds)
                    except RuntimeError:
                        pass
                return train(lighthouse.address(), r, 6, None, seeds, copies)  # (re)joins and catches up

            return list(pool.map(replica, [0, 1]))
    finally:
        lighthouse.shutdown()


@pytest.mark.parametrize(
    ("leave", "copies"), [(False, False), (True, False), (False, True)], ids=["healthy", "rejoin", "copies"]
)
def test_replicas_as_threads_end_identical(leave: bool, copies: bool) -> None:
    # copies: a state_dict() of copies, not the parameters; init_sync loads what it received
    a, b = run(leave, copies)
    assert a["step"] == b["step"] == 6
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, st in a["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)
