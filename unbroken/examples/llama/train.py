"""Trains the example Llama: FSDP2 inside each replica, unbroken's fault-tolerant average across.

    unbroken run --replicas 3 --ranks-per-replica 2 -- python examples/llama/train.py --steps 200

Each replica group shards the model over its ranks with ``fully_shard`` (each decoder layer,
then the root); FSDP2's all-reduce hook averages every reduced shard across replicas through
``manager.process_group()``, the torchtitan HSDP pattern with unbroken's group in place of the
replicate dimension of the mesh. AdamW with a linear warm-up and cosine decay (``LambdaLR``),
``clip_grad_norm_`` on the averaged gradient, bf16 autocast where the device runs it fast (CUDA
with bf16; on CPU autocast to bf16 made this model about 5x slower than fp32 on the machine it was
written on, so ``--bf16 auto`` keeps CPU runs in fp32).

Which samples each rank trains comes from :class:`unbroken.train.data.ReplicaBatches` (policy
``constant_global_batch`` by default: survivors take over a missing replica's samples by
gradient accumulation, so the run sees the fault-free sample order). The state a recovering
replica fetches and a checkpoint holds is ``unbroken.model_state(model, optimizer)``, the
schedule and the data account; ``unbroken run --checkpoint-dir`` turns unbroken's checkpoints
on, and ``--dcp-dir`` also saves plain DCP checkpoints through
:class:`unbroken.checkpoint.DCPWriter` (``torch.distributed.checkpoint.load`` reads them at any
world size). ``--init-dcp`` starts from a DCP checkpoint's model weights.

Without unbroken: ``--plain`` runs the same model, data and optimizer as a plain
``torch.distributed`` job (``torchrun --nproc-per-node 2 examples/llama/train.py --plain``: one
replica of 2 ranks; ``--ranks-per-replica K`` with a world of N*K ranks makes N replicas averaged
by a plain Gloo/NCCL all-reduce in the same hook). That is supported, with no fault tolerance;
it is also the baseline ``unbroken bench recovery --model llama`` compares the hook's cost
against (``--plain-alternate N`` times the same inside one unbroken job: N plain HSDP steps over
a static Gloo group, then N of unbroken's, in turn). Without ``--plain`` the script needs an
unbroken job (``unbroken run``): it is not a torchrun script.

Rank 0 of each replica appends one JSON line per step to ``{run_dir}/{--log-name}-r{R}.jsonl``
(after a ``{"event": "ready"}`` line); at the end every rank writes ``digest-r{R}-rank{K}.json``
(a SHA-256 of its shards of the model and optimizer state) and rank 0 ``digest-r{R}.json`` over
all ranks of its replica, so replicas can be compared bitwise without writing the state out.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken import config, fast_exit
from unbroken.examples.llama.llama_model import LlamaSize, build_model, decoder_layers
from unbroken.examples.llama.markov_tokens import MarkovTokens
from unbroken.train.data import CONSTANT_GLOBAL_BATCH, POLICIES, plan_step, rank_plan


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--samples-per-replica", type=int, default=8, help="Sequences per replica per step.")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10, help="Warm-up steps of the schedule.")
    ap.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_ threshold.")
    ap.add_argument("--policy", choices=POLICIES, default=CONSTANT_GLOBAL_BATCH)
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="Steps between unbroken checkpoints, when the job has a checkpoint directory.",
    )
    ap.add_argument("--dcp-dir", type=Path, default=None, help="Also save plain DCP checkpoints here (DCPWriter).")
    ap.add_argument("--dcp-every", type=int, default=10)
    ap.add_argument("--init-dcp", type=Path, default=None, help="Start from the model weights of this DCP checkpoint.")
    ap.add_argument(
        "--deadline-floor-s",
        type=float,
        default=1.5,
        help="The least time an all-reduce may take before its peer is presumed hung.",
    )
    ap.add_argument("--save-final", action="store_true", help="Tests: every rank saves its final shards.")
    ap.add_argument(
        "--pace-s", type=float, default=0.0, help="Make each step last at least this long, before its compute (tests)."
    )
    ap.add_argument("--log-name", default="metrics", help="Per-step records go to {run_dir}/{name}-r{R}.jsonl.")
    ap.add_argument("--plain", action="store_true", help="A plain torch.distributed job (torchrun), no unbroken.")
    ap.add_argument("--ranks-per-replica", type=int, default=0, help="With --plain: ranks per replica (default all).")
    ap.add_argument("--run-dir", type=Path, default=None, help="With --plain: where records go (default .).")
    ap.add_argument(
        "--check-alternate",
        type=int,
        default=0,
        help="Benchmarks: the verified exchange off, then on, every N steps, at the same steps in every "
        "replica, to time its cost within one job (0: always as UNBROKEN_VERIFY_EXCHANGE says).",
    )
    ap.add_argument(
        "--recorder-alternate",
        type=int,
        default=0,
        help="Benchmarks: the flight recorder and its shipments off, then on, every N steps (as "
        "--check-alternate; 0: always as UNBROKEN_RECORDER says).",
    )
    ap.add_argument(
        "--plain-alternate",
        type=int,
        default=0,
        help="Benchmarks: every N steps, switch between plain HSDP (a static Gloo group across the "
        "replicas, no quorum, vote or check; the replicas must stay up) and unbroken's step, to time "
        "unbroken's cost within one job (0: unbroken's step always).",
    )
    ap.add_argument(
        "--fault-step",
        type=int,
        default=-1,
        help="Tests: rank 1 of replica 1 kill -9s itself inside its all-reduce hook at this step (once).",
    )
    args = ap.parse_args(argv)
    if args.steps < 0 or args.samples_per_replica < 1 or args.warmup < 0:
        ap.error("--steps and --warmup must be >= 0 and --samples-per-replica >= 1")
    return args


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """The LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", config.local_rank() % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def use_bf16(choice: str, device: torch.device) -> bool:
    if choice == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return choice == "on"


def shard(model: torch.nn.Module, mesh: Any, all_reduce_hook: Callable[[torch.Tensor], None] | None) -> torch.nn.Module:
    """FSDP2 over ``mesh`` (one replica's ranks): each decoder layer, then the root."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if all_reduce_hook is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(all_reduce_hook)
    return model


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over this rank's shards of every parameter and optimizer-state tensor."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            v = value.to_local() if hasattr(value, "to_local") else value
            v = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            h.update(key.encode())
            h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def forward_backward(
    model: torch.nn.Module,
    data: MarkovTokens,
    micro_batches: Sequence[Sequence[int]],
    loss_scale: float,
    device: torch.device,
    bf16: bool,
) -> float | None:
    """Accumulates the step's micro-batches; FSDP reduces (and the hook averages) after the last.

    Returns the mean loss over them, None for a step with none (a replica catching up)."""
    losses = []
    for i, ids in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # type: ignore[operator]
        tokens = data.batch(ids).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=tokens, labels=tokens).loss
        (loss * loss_scale).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item() if losses else None


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Path, step: int) -> None:
    """A plain DCP checkpoint of this replica (a collective of its ranks) through unbroken's writer:
    checksummed files, an atomic rename into ``root/step-N``."""
    import torch.distributed.checkpoint as dcp

    from unbroken.checkpoint import DCPWriter

    state = dcp_state(model, optimizer if optimizer.state else None)
    dcp.save(state, storage_writer=DCPWriter(root, step=step))


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards: ``{"model": {name: tensor}, "optim": {name: {key: tensor}}}``."""

    def local(t: Any) -> Any:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().clone()

    return {
        "model": {n: local(p) for n, p in model.named_parameters()},
        "optim": {n: {k: local(v) for k, v in optimizer.state.get(p, {}).items()} for n, p in model.named_parameters()},
    }


def load_initial_weights(model: torch.nn.Module, path: Path) -> None:
    """Loads the ``model`` entry of a DCP checkpoint (plain DCP or unbroken's DCPWriter)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from unbroken.checkpoint import DCPReader

    state = dcp_state(model, None)
    dcp.load(state, storage_reader=DCPReader(path))
    set_model_state_dict(model, state["model"])


class Records:
    """Rank 0's per-step JSON lines and every rank's final digest."""

    def __init__(self, run_dir: Path, name: str, replica: int, rank: int) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.replica, self.rank = run_dir, replica, rank
        self.file = open(run_dir / f"{name}-r{replica}.jsonl", "a", buffering=1) if rank == 0 else None  # noqa: SIM115
        self.write({"event": "ready", "t": time.time(), "pid": os.getpid()})

    def write(self, row: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")

    def finish(self, step: int, digest: str, served: list[Any], group: Any = None) -> None:
        (self.run_dir / f"digest-r{self.replica}-rank{self.rank}.json").write_text(
            json.dumps({"step": step, "digest": digest})
        )
        digests: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, digest, group=group)  # this replica's ranks
        if self.rank == 0:
            whole = hashlib.sha256("".join(digests).encode()).hexdigest()
            (self.run_dir / f"digest-r{self.replica}.json").write_text(
                json.dumps({"step": step, "digest": whole, "served": served})
            )
            self.file.close()  # type: ignore[union-attr]


def main(argv: Sequence[str] | None = None) -> None:
    fast_exit.install()  # its exit is on the recovery path: see unbroken/fast_exit.py
    args = parse_args(argv)
    if args.plain:
        train_plain(args)
    else:
        train_unbroken(args)


def train_unbroken(args: argparse.Namespace) -> None:
    import unbroken
    from unbroken.comm.deadline import LearnedDeadline
    from unbroken.train.data import ReplicaBatches

    device = pick_device(args.device)
    bf16 = use_bf16(args.bf16, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # --- unbroken: join the job (it creates the replica's own process group) ----------------
    # The hook waits for each FSDP unit's all-reduce on its own, and most of those waits are
    # short (the peers compute the same units at the same time), so the deadline learned from
    # them sits at its floor; a new epoch's first all-reduce on a busy machine takes longer.
    deadline = LearnedDeadline(floor_s=args.deadline_floor_s)
    with unbroken.init(device=device, deadline=deadline) as manager:
        c = manager.config
        if not dist.is_initialized():  # a 1-rank replica: FSDP2 still wants a group
            dist.init_process_group(
                "gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1
            )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (c.world_size,))
        pg = manager.process_group()  # the replicas of this step's quorum, for gradients only
        run_dir = Path(c.run_dir)
        armed = args.fault_step >= 0 and c.replica_id == 1 and c.rank == 1 and not (run_dir / "fault.json").exists()
        plain = PlainBlocks(args.plain_alternate, run_dir, c.replica_id, c.rank, c.num_replicas)

        def all_reduce_hook(t: torch.Tensor) -> None:
            nonlocal armed
            if plain.now:
                plain.all_reduce(t)
                return
            if armed and manager.step == args.fault_step:  # tests: die inside the exchange
                armed = False
                (run_dir / "fault.json").write_text(json.dumps({"step": manager.step, "pid": os.getpid()}))
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG)

        model = shard(build_model(LlamaSize(), args.seed).to(device), mesh, all_reduce_hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
        data = MarkovTokens(LlamaSize().vocab_size, args.seq_len)
        batches = ReplicaBatches(manager, args.samples_per_replica, args.policy)
        state = unbroken.model_state(model, optimizer)
        manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
        manager.register_state_dict_fn("schedule", scheduler.load_state_dict, scheduler.state_dict)
        manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)
        manager.expect_gradients(unbroken.gradient_numel(model.parameters()))
        checkpointer = unbroken.checkpointer_for(manager)
        unbroken.resume(manager, checkpointer)
        if args.init_dcp is not None and manager.step == 0:
            load_initial_weights(model, args.init_dcp)
            if args.dcp_dir is not None and c.replica_id == 0:  # a record of where training started
                save_dcp(model, optimizer, args.dcp_dir, 0)
        # ------------------------------------------------------------------------------------
        records = Records(run_dir, args.log_name, c.replica_id, c.rank)
        recorder = manager.recorder
        while manager.step < args.steps and not plain.finished(args.steps):
            if plain.next():  # benchmarks: a block of plain HSDP steps (see --plain-alternate)
                row = plain_step(
                    model, optimizer, scheduler, data, plain.steps - 1, plain.plan(args), device, bf16, args
                )
                records.write(row | {"unbroken": False})
                continue
            if args.check_alternate > 0:  # every member switches at the same step (see --check-alternate)
                manager.sdc.enabled = (manager.step // args.check_alternate) % 2 == 1
            if args.recorder_alternate > 0 and recorder is not None:  # between steps: no collective open
                on = (manager.step // args.recorder_alternate) % 2 == 1
                manager.recorder = manager.group.recorder = recorder if on else None
                manager.client.telemetry = recorder.batch if on else None  # plain heartbeats meanwhile
            t0 = time.time()
            c0 = time.thread_time()
            manager.start_step()  # the quorum request travels while the batches are read
            plan = batches.plan()  # this rank's micro-batches: waits for the step's quorum
            t_plan = time.time()
            if args.pace_s > 0:
                # Before the compute, whose backward runs the exchange (the FSDP2 hooks): every replica
                # then reaches it together. Slept after it, each kept its own phase, and the one whose
                # clock ran latest arrived last at every exchange (a false straggler to the diagnosis).
                time.sleep(max(0.0, args.pace_s - (t_plan - t0)))
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(model, data, plan.micro_batches, plan.loss_scale, device, bf16)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            t_exchange = time.time()
            # Ends the step's exchange (already done in the hook unless a replica catches up;
            # a catching-up replica has no gradients and sends zeros): True when it may commit.
            committed = unbroken.average_gradients(manager, model.parameters())
            if committed:
                if not plain.due():
                    manager.request_next_quorum()  # the answer travels while the optimizer steps
                optimizer.step()
                scheduler.step()
                manager.commit()
                batches.commit(plan)
                unbroken.save_if_due(manager, checkpointer, args.checkpoint_every)
                if args.dcp_dir is not None and manager.step % args.dcp_every == 0 and manager.writes_checkpoints:
                    save_dcp(model, optimizer, args.dcp_dir, manager.step)
            cpu_s = time.thread_time() - c0
            t1 = time.time()
            d = manager.decision
            st = manager.stats
            records.write(
                {
                    "step": plan.step,
                    "committed": committed,
                    "loss": loss,
                    "norm": float(norm),
                    "lr": scheduler.get_last_lr()[0],
                    "epoch": d.epoch if d else None,
                    "members": list(d.members) if d else [],
                    "behind": list(d.behind) if d else [],
                    "donor": any(dn == c.replica_id for _, dn in (d.donors if d else ())),
                    "slots": list(plan.plan.slots.get(c.replica_id, ())),
                    "loss_scale": plan.loss_scale,
                    "samples_skipped": batches.account.samples_skipped,
                    "samples_repeated": batches.account.samples_repeated,
                    "t": t1,
                    "recovered": c.replica_id in (d.behind if d else ()),
                    "t0": t0,
                    "t1": t1,
                    "step_s": t1 - t0,
                    "compute_s": t_exchange - t0,
                    "quorum_wait_s": t_plan - t0,
                    "cpu_s": cpu_s,
                    "exchange_s": st["last_exchange_s"],
                    "recovery_s": st["last_recovery_s"],
                    "fetch_s": st.get("last_fetch_s", 0.0),
                    "snapshot_s": st.get("last_snapshot_s", 0.0),
                    "snapshot_early": bool(st.get("last_snapshot_early", 0.0)),
                    "checked": manager.sdc.enabled,
                    "recorded": manager.recorder is not None,
                    "sdc_detected": manager.sdc.detected,
                    "check_s": manager.sdc.spent_s,  # cumulative: the exchange check's own time
                    "check_cpu_s": manager.sdc.cpu_s,  # cumulative: of which this thread's CPU
                    "early_swaps": manager.sdc.early_swaps,  # cumulative (sdc_check.ExchangeCheck.start)
                    "pid": os.getpid(),
                }
                | plain.label(plan.step)
            )
        if checkpointer is not None:
            checkpointer.close()
        if args.save_final:
            torch.save(
                {"step": manager.step, **local_state(model, optimizer)},
                run_dir / f"final-r{c.replica_id}-rank{c.rank}.pt",
            )
        records.finish(manager.step, state_digest(model, optimizer), manager.catchup.served if c.rank == 0 else [])
        dist.barrier()  # no rank tears its groups down while a sibling still uses them
    dist.destroy_process_group()


def plain_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: MarkovTokens,
    step: int,
    plan: Any,
    device: torch.device,
    bf16: bool,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One step of plain HSDP (the all-reduce is in the FSDP2 hook); its record."""
    t0 = time.time()
    c0 = time.thread_time()
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, data, plan.micro_batches, plan.loss_scale, device, bf16)
    t_exchange = time.time()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
    optimizer.step()
    scheduler.step()
    cpu_s = time.thread_time() - c0
    t1 = time.time()
    return {
        "step": step,
        "committed": True,
        "loss": loss,
        "norm": float(norm),
        "t0": t0,
        "t1": t1,
        "step_s": t1 - t0,
        "compute_s": t_exchange - t0,
        "cpu_s": cpu_s,
    }


class PlainBlocks:
    """Benchmarks only (``--plain-alternate N``): blocks of N plain HSDP steps between blocks of
    N of unbroken's, at the same steps in every replica, so that ``unbroken bench recovery
    --alternate-steps`` times unbroken's cost against plain HSDP inside one job (two jobs on
    one shared machine differ by more than the cost). The plain steps average over a static Gloo
    group of the replicas' same-numbered ranks (a file store in the run directory), with no
    quorum, vote or check: no replica may fail meanwhile. Steps are counted here (``steps``),
    since unbroken's step count does not move in plain blocks.
    """

    def __init__(self, every: int, run_dir: Path, replica: int, rank: int, replicas: int) -> None:
        self.every, self.replica, self.rank, self.replicas = every, replica, rank, replicas
        self.steps = 0  # steps begun, plain or not
        self.now = False  # the step begun last is plain
        self.group: Any = None
        if every > 0:
            store = dist.FileStore(str(run_dir / f"plain-store-rank{rank}"), replicas)
            self.group = dist.ProcessGroupGloo(store, replica, replicas, datetime.timedelta(seconds=300))

    def finished(self, steps: int) -> bool:
        """Whether alternate blocks have run ``steps`` steps in all."""
        return self.every > 0 and self.steps >= steps

    def due(self) -> bool:
        """Whether the next step is plain."""
        return self.every > 0 and (self.steps // self.every) % 2 == 0

    def next(self) -> bool:
        """Begins a step: whether it is plain."""
        self.now = self.due()
        self.steps += 1
        return self.now

    def plan(self, args: argparse.Namespace) -> Any:
        """This rank's micro-batches of the plain step begun last, as ``--plain`` plans them."""
        return rank_plan(
            plan_step(self.steps - 1, self.replicas, range(self.replicas), args.policy),
            self.replica,
            self.rank,
            dist.get_world_size(),
            self.replicas,
            args.samples_per_replica,
        )

    def all_reduce(self, t: torch.Tensor) -> None:
        """The plain HSDP average across replicas (as ``--plain``'s hook)."""
        self.group.allreduce([t]).wait()
        t.div_(self.replicas)

    def label(self, step: int) -> dict[str, Any]:
        """Fields an unbroken step's record gets where blocks alternate: the step as counted
        here (blocks are cut by it), and unbroken's own."""
        if self.every <= 0:
            return {}
        return {"step": self.steps - 1, "unbroken_step": step, "unbroken": True}


def train_plain(args: argparse.Namespace) -> None:
    """The same training with torch alone: N replicas x K ranks from torchrun's environment."""
    device = pick_device(args.device)
    bf16 = use_bf16(args.bf16, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL refuses two ranks on one GPU: ranks that share GPUs (more ranks on this node than GPUs)
    # carry their CUDA tensors over Gloo, as unbroken's `auto` does across replicas.
    shared = config.local_world_size() > torch.cuda.device_count()
    dist.init_process_group("gloo" if device.type == "cpu" else "cuda:gloo,cpu:gloo" if shared else "nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    per = args.ranks_per_replica or world
    if world % per:
        raise SystemExit(f"--ranks-per-replica {per} does not divide the world size {world}")
    replicas, replica, local = world // per, rank // per, rank % per
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (replicas, per), mesh_dim_names=("replicate", "shard"))
    across = mesh["replicate"].get_group() if replicas > 1 else None

    def all_reduce_hook(t: torch.Tensor) -> None:  # a plain HSDP all-reduce over the replicas
        dist.all_reduce(t, group=across)
        t.div_(replicas)

    model = shard(
        build_model(LlamaSize(), args.seed).to(device), mesh["shard"], all_reduce_hook if across is not None else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    data = MarkovTokens(LlamaSize().vocab_size, args.seq_len)
    if args.init_dcp is not None:
        load_initial_weights(model, args.init_dcp)
    records = Records(args.run_dir or Path("."), args.log_name, replica, local)
    for step in range(args.steps):
        plan = rank_plan(
            plan_step(step, replicas, range(replicas), args.policy),
            replica,
            local,
            per,
            replicas,
            args.samples_per_replica,
        )
        records.write(plain_step(model, optimizer, scheduler, data, step, plan, device, bf16, args))
    records.finish(args.steps, state_digest(model, optimizer), [], group=mesh["shard"].get_group())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
