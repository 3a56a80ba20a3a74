"""One replica of ``unbroken bench recovery``: a plain MLP, timed step by step.

    python -m unbroken.bench.training.recovery_worker --mode unbroken --params-m 25 --steps 60 --out DIR

``--mode unbroken`` joins a job started by the launcher; ``--mode baseline`` is the same loop
with a plain ``torch.distributed`` all-reduce and nothing of unbroken (RANK/WORLD_SIZE/MASTER_*
from the environment), so the two step times compare the protocol's cost and nothing else.
``--mode ddp`` is unbroken's ``DistributedDataParallel`` (gradients averaged during backward)
under the launcher, and ``--mode torch_ddp`` the same loop with
``torch.nn.parallel.DistributedDataParallel`` on a plain Gloo group, its reference.
``--mode torchft`` is the same DDP loop written against torchft's API on unbroken's facade
(``unbroken.torchft``: ``Manager``, ``DistributedDataParallel``, ``Optimizer``), so that its step
time against ``--mode ddp`` is the facade's own cost.
``--model gpt`` trains the example GPT (``unbroken.examples.gpt``) instead of the MLP.
Every step appends one JSON line to ``DIR/steps-r{R}.jsonl``; at the end the worker writes a
digest of its parameters and optimizer state, which is how the benchmark checks that replicas
are bitwise identical without writing hundreds of megabytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken import fast_exit


def build_mlp(params_m: float, width: int = 1024) -> torch.nn.Sequential:
    """An MLP of about ``params_m`` million parameters made of ``width``-wide layers."""
    per_layer = width * width + width
    layers = max(1, round(params_m * 1e6 / per_layer))
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over every parameter and optimizer-state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for idx in sorted(optimizer.state_dict()["state"]):
        for key, value in sorted(optimizer.state_dict()["state"][idx].items()):
            h.update(f"{idx}.{key}".encode())
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_model(name: str, params_m: float) -> tuple[torch.nn.Module, Any]:
    """The model and ``loss(model, step, replica, batch_size)`` for it."""
    if name == "mlp":
        mlp = build_mlp(params_m)
        first = mlp[0]
        assert isinstance(first, torch.nn.Linear)  # build_mlp starts with one
        width = first.in_features

        def mlp_loss(model: torch.nn.Module, step: int, replica: int, batch_size: int) -> torch.Tensor:
            x, y = batch_for(step, replica, batch_size, width)
            return torch.nn.functional.mse_loss(model(x), y)

        return mlp, mlp_loss
    from unbroken.examples.gpt.bigram_text import batch, make_corpus
    from unbroken.examples.gpt.gpt_model import GPT, GPTConfig

    cfg = GPTConfig()
    corpus = make_corpus(cfg.vocab_size, seed=1234)

    def gpt_loss(model: torch.nn.Module, step: int, replica: int, batch_size: int) -> torch.Tensor:
        x, y = batch(corpus, step, replica, 8, batch_size, cfg.block_size)
        return model(x, y)

    return GPT(cfg), gpt_loss


def batch_for(step: int, replica: int, batch_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of (step, replica): a restarted replica resumes on exactly the right data."""
    g = torch.Generator().manual_seed(step * 1009 + replica)
    return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, width, generator=g)


def main() -> None:
    fast_exit.install()  # its exit is on the recovery path: see unbroken/fast_exit.py
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=("unbroken", "baseline", "ddp", "torch_ddp", "torchft"), required=True)
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--params-m", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--recorder-alternate",
        type=int,
        default=0,
        help="The flight recorder and its shipments off, then on, every N steps (the same steps in "
        "every replica), to time it within one job (unbroken.bench.training.alternate); 0: never.",
    )
    args = ap.parse_args()

    torch.manual_seed(0)
    model, loss_of = build_model(args.model, args.params_m)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    params = [p for p in model.parameters()]
    args.out.mkdir(parents=True, exist_ok=True)
    unbroken_loop = args.mode in ("unbroken", "ddp", "torchft")
    facade: Any = None  # the torchft Manager of --mode torchft
    net: torch.nn.Module = model  # what the loop calls: the model or its DDP wrapper

    if unbroken_loop:
        import unbroken

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])

        if args.mode == "torchft":
            from unbroken import torchft

            facade = torchft.Manager(
                pg=torchft.ProcessGroupGloo(),
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=1,
            )
            manager = facade._manager
            optimizer: Any = torchft.Optimizer(facade, inner)
            net = torchft.DistributedDataParallel(facade, model)
        else:
            manager = unbroken.init(state_dict=state_dict, load_state_dict=load_state_dict)
            optimizer = unbroken.Optimizer(inner, manager)
        replica = manager.config.replica_id
        if args.mode == "ddp":
            net = unbroken.DistributedDataParallel(model, manager)
    else:
        dist.init_process_group("gloo")
        replica = dist.get_rank()
        world = dist.get_world_size()
        if args.mode == "torch_ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)

    log = open(args.out / f"steps-r{replica}.jsonl", "a", buffering=1)  # noqa: SIM115
    log.write(json.dumps({"event": "ready", "t": time.time(), "pid": os.getpid()}) + "\n")
    step = 0
    checked_s = 0.0  # the verified exchange's seconds before this step (manager.sdc.spent_s)
    recorder = manager.recorder if unbroken_loop else None
    while step < args.steps:
        if args.recorder_alternate > 0 and recorder is not None:  # between steps: no collective open
            on = (step // args.recorder_alternate) % 2 == 1
            manager.recorder = manager.group.recorder = recorder if on else None
            manager.client.telemetry = recorder.batch if on else None  # plain heartbeats meanwhile
        t0 = time.time()
        if unbroken_loop:
            optimizer.zero_grad()
            step = manager.step
        else:
            inner.zero_grad()
        loss = loss_of(net, step, replica, args.batch_size)
        loss.backward()
        t_exchange = time.time()
        if unbroken_loop:
            optimizer.step()
            committed = manager.last_step_committed
            d = manager.decision
            row = {
                "epoch": d.epoch if d else None,
                "members": list(d.members) if d else [],
                "behind": list(d.behind) if d else [],
                "donor": any(dn == replica for _, dn in (d.donors if d else ())),
                "step": d.step if d else step,
                "committed": committed,
                "exchange_s": manager.stats["last_exchange_s"],
                "join_wait_s": manager.stats["last_join_wait_s"],
                "quorum_wait_s": manager.stats["last_quorum_wait_s"],
                "check_s": manager.sdc.spent_s - checked_s,
                "prepared_hits": manager.group.prepared_hits,
                "recovery_s": manager.stats["last_recovery_s"],
                "fetch_s": manager.stats.get("last_fetch_s", 0.0),
                "load_s": manager.stats.get("last_load_s", 0.0),
                "snapshot_s": manager.stats.get("last_snapshot_s", 0.0),
                "snapshot_wait_s": manager.stats.get("last_snapshot_wait_s", 0.0),
                "snapshot_early": bool(manager.stats.get("last_snapshot_early", 0.0)),
                "fetch_cpu_s": manager.stats.get("last_fetch_cpu_s", 0.0),
                "recorded": manager.recorder is not None,
            }
            if args.mode in ("ddp", "torchft"):  # the exchange ran during backward: how much of it was left to wait for
                row["busy_s"] = manager.stats.get("last_exchange_busy_s", 0.0)
            checked_s = manager.sdc.spent_s
            step = manager.step
        elif args.mode == "torch_ddp":
            inner.step()
            row = {"step": step, "committed": True}
            step += 1
        else:
            flat = torch._utils._flatten_dense_tensors([p.grad for p in params])
            dist.all_reduce(flat)
            flat.div_(world)
            averaged = torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])
            for p, g in zip(params, averaged, strict=False):
                assert p.grad is not None  # flattened above
                p.grad.copy_(g)
            inner.step()
            row = {"step": step, "committed": True}
            step += 1
        t1 = time.time()
        log.write(
            json.dumps(
                {
                    **row,
                    "t0": t0,
                    "t1": t1,
                    "step_s": t1 - t0,
                    "compute_s": t_exchange - t0,
                    "loss": loss.item(),
                    "pid": os.getpid(),
                }
            )
            + "\n"
        )
    served = manager.catchup.served if unbroken_loop else []
    (args.out / f"digest-r{replica}.json").write_text(
        json.dumps({"step": step, "digest": state_digest(model, inner), "served": served})
    )
    if facade is not None:
        facade.shutdown()
    elif unbroken_loop:
        manager.shutdown()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
