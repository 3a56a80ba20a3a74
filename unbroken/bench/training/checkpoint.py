"""``unbroken bench checkpoint``: torch.save, DCP, DCP async and unbroken on the same state.

The state is a plain MLP's parameters plus its Adam state, sized to ``--size-mb``. Each system
saves it inside real training steps, so ``stall_s`` is the time the training thread is blocked
(for unbroken with ``overlap=True``: the ``save`` call plus any wait at the optimizer guard,
while the next forward/backward ran), then once more while idle for ``durable_s`` (from the
save call until data and directory are fsynced). Restores fill the existing tensors in place;
before each system's restore from disk its files are evicted from the page cache
(:func:`drop_cache`), so every system reads from the device, as after a node restart.

The machine is shared and noisy, so nothing is compared across runs: in each of ``--rounds``
rounds every system and a plain write+fsync of the same bytes are measured in turn (order
rotated); a system's figure is its median over rounds, and each target ratio is computed per
round (median, min and max reported). ``every_step_slowdown`` comes from the example's GPT
(unbroken.examples.gpt) trained with and without a checkpoint at every step, alternated the same way.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import click
import torch

from unbroken.bench.output import publish
from unbroken.checkpoint.storage.disk import fsync_dir


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mlp(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


class Trainer:
    """An MLP, its Adam optimizer and a batch: the thing whose state is checkpointed."""

    def __init__(self, width: int, layers: int, batch: int, seed: int = 0, device: str = "cpu") -> None:
        torch.manual_seed(seed)
        self.model = _mlp(width, layers).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width, device=device)
        self.step(self.forward_backward())  # creates the Adam state

    def forward_backward(self) -> float:
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        return float(loss)

    def step(self, _: float) -> None:
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": 0}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state()))


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


def _sized_trainer(size_mb: int, device: str = "cpu") -> Trainer:
    """An MLP whose parameters + Adam moments total about ``size_mb``: 3 fp32 copies."""
    width = 2048 if size_mb >= 256 else 512
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(size_mb * 2**20 / per_layer))
    return Trainer(width, layers, batch=16, device=device)


def write_fsync(nbytes: int, directory: str) -> float:
    """Seconds for a plain write + fsync of ``nbytes`` from warm memory: the disk's floor."""
    buf = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    path = os.path.join(directory, "plain.bin")
    started = time.perf_counter()
    with open(path, "wb") as f:
        view = memoryview(buf)
        for i in range(0, len(view), 32 << 20):
            f.write(view[i : i + (32 << 20)])
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)
    took = time.perf_counter() - started
    os.unlink(path)
    return took


def drop_cache(root: str) -> None:
    """Evict every file under ``root`` from the page cache, so that a restore reads the device.

    Each system's restore is timed from the same state, a cold cache as after a node restart:
    otherwise a system that writes through the page cache (torch.save, DCP) is timed reading
    memory while one that writes with direct I/O (unbroken) is timed reading the disk, and the
    ratio swings with whatever else touched the cache. The files are fsynced, so their pages
    are clean and ``POSIX_FADV_DONTNEED`` drops them.
    """
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _copy_tree_into(dst: Any, src: Any) -> None:
    for d, s in zip(_tensors(dst), _tensors(src), strict=False):
        d.copy_(s)


class System:
    """One way of checkpointing, driven the same way for all."""

    name = ""
    root = ""

    def save(self, step: int, state: dict[str, Any]) -> None: ...
    def fence(self) -> None: ...
    def wait(self) -> None: ...
    def restore_disk(self, state: dict[str, Any]) -> None: ...
    def restore_memory(self, state: dict[str, Any]) -> None | bool:
        return False

    def close(self) -> None: ...


class TorchSave(System):
    def __init__(self, root: str) -> None:
        self.root = root
        self.path = ""

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.path:
            os.unlink(self.path)  # keep one, as the others do (rounds must not fill the disk)
        self.path = os.path.join(self.root, f"step{step}.pt")
        with open(self.path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.root)

    def restore_disk(self, state: dict[str, Any]) -> None:
        _copy_tree_into(state, torch.load(self.path, weights_only=True))


class Dcp(System):
    def __init__(self, root: str, mode: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp, self.root, self.mode, self.path = dcp, root, mode, ""
        self.kind = AsyncCheckpointerType.PROCESS
        # Fastest CPU mode in torch 2.13: a checkpoint process fed from shared memory, with a
        # stager that keeps and reuses its staging buffers across saves.
        self.options = StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
        self.new_stager = DefaultStager
        self.stager = DefaultStager(self.options)
        self.future: Any = None

    def _usable_stager(self) -> Any:
        """The stager, or a new one where DCP closed it after its last stage: torch 2.11's
        ``DefaultStager`` does so after every stage, and a closed stager's next stage fails
        (``KeyError: <class 'type'>``, seen on the H200 with torch 2.11). It then reuses no buffer
        from one save to the next whatever we do, so a new one per save is DCP as it is there."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager.close()
            self.stager = self.new_stager(self.options)
        return self.stager

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
        self.path = os.path.join(self.root, f"step{step}")
        if self.mode == "sync":
            self.dcp.save(state, checkpoint_id=self.path)
        else:
            self.future = self.dcp.async_save(
                state, checkpoint_id=self.path, async_stager=self._usable_stager(), async_checkpointer_type=self.kind
            )

    def wait(self) -> None:
        if self.future is not None:
            result = self.future
            (result.upload_completion if hasattr(result, "upload_completion") else result).result()
            self.future = None

    def restore_disk(self, state: dict[str, Any]) -> None:
        self.dcp.load(state, checkpoint_id=self.path)

    def close(self) -> None:
        self.wait()
        self.stager.close()


class Unbroken(System):
    def __init__(self, root: str, overlap: bool, **options: Any) -> None:
        from unbroken.checkpoint import Checkpointer

        self.root, self.overlap = root, overlap
        self.ck = Checkpointer(root, keep_last=2, overlap=overlap, **options)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.ck.save(step, state)

    def fence(self) -> None:
        self.ck.fence()

    def wait(self) -> None:
        failed = [o for o in self.ck.wait() if not o.ok]
        if failed:
            raise RuntimeError(failed[0].error)

    def restore_memory(self, state: dict[str, Any]) -> bool:
        return self.ck.load_latest(into=state).source == "memory"

    def restore_disk(self, state: dict[str, Any]) -> None:
        from unbroken.checkpoint import Checkpointer

        fresh = Checkpointer(self.root, keep_last=2)  # a new process's view: no memory tier
        try:
            assert fresh.load_latest(into=state).source == "disk"
        finally:
            fresh.close()

    def close(self) -> None:
        self.ck.close()


def measure_round(system: System, trainer: Trainer, step: int) -> dict[str, Any]:
    """One round for one system: a save inside a training step (stall), one while idle
    (durable), then restores from memory (where it has one) and from disk."""
    state = trainer.state()
    loss = trainer.forward_backward()
    system.fence()
    trainer.step(loss)
    started = time.perf_counter()
    system.save(step, state)
    stall = time.perf_counter() - started
    loss = trainer.forward_backward()  # the next step reads, but does not change, the weights
    started = time.perf_counter()
    system.fence()
    stall += time.perf_counter() - started
    trainer.step(loss)
    system.wait()
    started = time.perf_counter()  # idle: nothing of ours competes with the save
    system.save(step + 1, state)
    system.wait()
    out: dict[str, Any] = {"stall_s": stall, "durable_s": time.perf_counter() - started}
    started = time.perf_counter()
    if system.restore_memory(state):
        out["restore_memory_s"] = time.perf_counter() - started
    drop_cache(system.root)
    started = time.perf_counter()
    system.restore_disk(state)
    out["restore_disk_s"] = time.perf_counter() - started
    return out


def every_step(steps: int, make: Callable[[], Unbroken] | None, trainer: Any) -> tuple[float, int]:
    """Seconds for ``steps`` training steps, checkpointing every step if ``make`` is given;
    also how many snapshots were replaced by a newer one before reaching the disk."""
    system = make() if make else None
    state = trainer.state()
    if system is not None:
        system.save(0, state)
        system.wait()
    started = time.perf_counter()
    for s in range(1, steps + 1):
        loss = trainer.forward_backward()
        if system is not None:
            system.fence()
        trainer.step(loss)
        if system is not None:
            system.save(s, state)
    took = time.perf_counter() - started
    skipped = 0
    if system is not None:
        skipped = system.ck.coalesced
        system.close()
    return took, skipped


class GptTrainer:
    """The example's training (unbroken.examples.gpt): its GPT, AdamW and batches, one replica."""

    def __init__(self) -> None:
        from unbroken.examples.gpt import bigram_text, gpt_model

        torch.manual_seed(0)
        cfg = gpt_model.GPTConfig()
        self.model = gpt_model.GPT(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        corpus = bigram_text.make_corpus(cfg.vocab_size, seed=1234)
        self.batches = [bigram_text.batch(corpus, s, 0, 1, 16, cfg.block_size) for s in range(8)]
        self.i = 0
        self.step(self.forward_backward())

    def forward_backward(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=False)
        idx, tgt = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = self.model(idx, tgt)
        loss.backward()
        return loss.detach()

    def step(self, _: Any) -> None:
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.i,
        }

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state()))


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    size_mb: int, steps: int, rounds: int, workdir: str, every_step_rounds: int | None = None, device: str = "cpu"
) -> dict[str, Any]:
    """Every system, and the plain write+fsync, measured once per round in turn (rotating
    the order), so that each ratio compares figures taken seconds apart on this noisy machine.
    ``device``: where the checkpointed state lives (``cuda``: saves copy it out of device memory,
    restores copy it back in)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's saver needs a group
    makers: dict[str, Callable[[str], System]] = {
        "torch_save": TorchSave,
        "dcp": lambda d: Dcp(d, "sync"),
        "dcp_async": lambda d: Dcp(d, "async"),
        "unbroken": lambda d: Unbroken(d, overlap=True),
    }
    live: dict[str, System] = {}
    try:
        trainer = _sized_trainer(size_mb, device)
        nbytes = trainer.nbytes()
        _log(f"state: {nbytes / 2**20:.0f} MiB in {len(_tensors(trainer.state()))} tensors")
        for name, make in makers.items():
            os.makedirs(os.path.join(workdir, name))
            live[name] = make(os.path.join(workdir, name))
            live[name].save(0, trainer.state())  # allocations and helper processes, not timed
            live[name].wait()
        per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
        plain: list[float] = []
        names = list(makers)
        for r in range(rounds):
            plain.append(write_fsync(nbytes, workdir))
            _log(f"round {r + 1}/{rounds}: write+fsync {plain[-1]:.3f}s")
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_round[name].append(measure_round(live[name], trainer, 10 * (r + 1)))
                _log(f"  {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in per_round[name][-1].items()))
        systems = {}
        for name, rows in per_round.items():
            systems[name] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            if "restore_memory_s" in systems[name]:
                systems[name]["restore_memory_gb_s"] = round(nbytes / 1e9 / systems[name]["restore_memory_s"], 2)
            systems[name]["restore_disk_gb_s"] = round(nbytes / 1e9 / systems[name]["restore_disk_s"], 2)
            systems[name]["rounds"] = rows
        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "size_mb": round(nbytes / 2**20),
            "rounds": rounds,
            "write_fsync_s": statistics.median(plain),
            "write_fsync_rounds_s": plain,
            "systems": systems,
        }
    finally:
        for system in live.values():
            system.close()
        dist.destroy_process_group()
    result.update(every_step_runs(steps, every_step_rounds or rounds, workdir))
    result["targets"] = _targets(result, per_round, plain)
    return result


def every_step_runs(steps: int, rounds: int, workdir: str) -> dict[str, Any]:
    """The example's training with and without a checkpoint at every step, alternated.

    Checkpointed twice per round: with the Checkpointer's defaults (every step snapshotted in
    memory, the newest written to disk at most once per ``persist_interval_s``), which gives
    ``every_step_slowdown``; and with ``persist_interval_s=0`` (a disk write whenever the
    previous one is done), reported as ``every_step_disk_every_chance_slowdown``.
    """
    from unbroken.checkpoint.checkpointer import DEFAULT_PERSIST_INTERVAL_S

    root = os.path.join(workdir, "every_step")
    trainer = GptTrainer()
    out: dict[str, Any] = {"every_step_model_mb": round(trainer.nbytes() / 2**20, 2)}
    variants: dict[str, dict[str, Any]] = {"default": {}, "disk_every_chance": {"persist_interval_s": 0.0}}
    base: list[float] = []
    ckpt: dict[str, list[float]] = {v: [] for v in variants}
    skipped: dict[str, list[int]] = {v: [] for v in variants}
    for r in range(rounds + 1):  # round 0 warms up every path and is not counted
        plain_s, _ = every_step(steps, None, trainer)
        line = f"every step, round {r}: {plain_s / steps * 1e3:.1f} ms/step without"
        if r:
            base.append(plain_s)
        for name, options in variants.items():
            shutil.rmtree(root, ignore_errors=True)
            ck_s, n = every_step(steps, partial(Unbroken, root, overlap=True, **options), trainer)
            if r:
                ckpt[name].append(ck_s)
                skipped[name].append(n)
            line += f"; {ck_s / steps * 1e3:.1f} with {name} ({n} coalesced)"
        _log(line)
    ratios = {name: [c / b - 1 for b, c in zip(base, runs, strict=False)] for name, runs in ckpt.items()}
    out.update(
        {
            "every_step_steps": steps,
            "every_step_persist_interval_s": DEFAULT_PERSIST_INTERVAL_S,
            "every_step_base_step_s": statistics.median(base) / steps,
            "every_step_ckpt_step_s": statistics.median(ckpt["default"]) / steps,
            "every_step_slowdown": statistics.median(ratios["default"]),
            "every_step_slowdown_rounds": ratios["default"],
            "every_step_coalesced": skipped["default"],
            "every_step_disk_every_chance_step_s": statistics.median(ckpt["disk_every_chance"]) / steps,
            "every_step_disk_every_chance_slowdown": statistics.median(ratios["disk_every_chance"]),
            "every_step_disk_every_chance_slowdown_rounds": ratios["disk_every_chance"],
            "every_step_disk_every_chance_coalesced": skipped["disk_every_chance"],
        }
    )
    return out


def _targets(r: dict[str, Any], per_round: dict[str, list[dict[str, Any]]], plain: list[float]) -> dict[str, Any]:
    """The issue's targets as figures (not pass/fail): each ratio per round, with its median
    and min, plus the ratio of the medians."""
    ub, da, dcp = per_round["unbroken"], per_round["dcp_async"], per_round["dcp"]
    gib = r["size_mb"] / 1024
    nbytes = r["size_mb"] * 2**20

    def ratio(values: list[float]) -> dict[str, Any]:
        return {**_stats(values), "rounds": values}

    return {
        "stall_vs_dcp_async": ratio([u["stall_s"] / d["stall_s"] for u, d in zip(ub, da, strict=False)]),
        "stall_s_per_gib": ratio([u["stall_s"] / gib for u in ub]),
        "durable_vs_write_fsync": ratio([p / u["durable_s"] for p, u in zip(plain, ub, strict=False)]),
        "restore_memory_gb_s": ratio([nbytes / 1e9 / u["restore_memory_s"] for u in ub]),
        "restore_disk_vs_dcp_load": ratio(
            [d["restore_disk_s"] / u["restore_disk_s"] for u, d in zip(ub, dcp, strict=False)]
        ),
        "every_step_slowdown": ratio(r["every_step_slowdown_rounds"]),
    }


@click.command()
@click.option(
    "--size-mb",
    type=click.IntRange(min=8),
    default=1024,
    show_default=True,
    help="Size of the checkpointed state (an MLP plus its Adam state).",
)
@click.option(
    "--steps", type=click.IntRange(min=5), default=100, show_default=True, help="Training steps in each every-step run."
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Rounds in which every system is measured once, in turn.",
)
@click.option(
    "--every-step-rounds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Rounds of the every-step runs (one without checkpoints, then each variant with).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where checkpoints are written (default: a temporary directory under runs/).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the checkpointed state lives (cuda: the state is in GPU memory).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="runs/bench/checkpoint.json",
    show_default=True,
    help="Where the JSON is also written.",
)
def checkpoint(
    size_mb: int,
    steps: int,
    rounds: int,
    every_step_rounds: int,
    workdir: str | None,
    device: str,
    as_json: bool,
    out: str,
) -> None:
    """Stall, durable time and restores of four checkpointers on one state; every-step cost."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: this machine's torch sees no CUDA GPU")
    os.makedirs("runs", exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=workdir or "runs")
    try:
        result = run(size_mb, steps, rounds, work, every_step_rounds, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    publish(result, out, as_json)
    if not as_json:
        t = result["targets"]
        for name, s in result["systems"].items():
            click.echo(
                f"{name:20s} stall {s['stall_s']:.4f}s  durable {s['durable_s']:.3f}s  "
                f"restore disk {s['restore_disk_s']:.3f}s  memory {s.get('restore_memory_s', '-')}"
            )
        click.echo(f"write+fsync {result['write_fsync_s']:.3f}s (medians of {result['rounds']} rounds)")
        for k, v in t.items():
            click.echo(f"{k:26s} median {v['median']:.3g}  min {v['min']:.3g}  max {v['max']:.3g}")
