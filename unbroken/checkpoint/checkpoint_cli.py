"""``unbroken checkpoint ls|verify|export|serve-peer``: inspect and move checkpoints."""

from __future__ import annotations

import os

import click

from unbroken.checkpoint.peer import DEFAULT_MAX_BYTES


def _require_dir(directory: str) -> None:
    if not os.path.isdir(directory):
        raise click.UsageError(f"{directory!r} is not a directory; pass a checkpoint directory")


@click.group()
def checkpoint() -> None:
    """Inspect, verify and export checkpoints written by unbroken's Checkpointer."""


@checkpoint.command("ls")
@click.argument("directory")
def ls_cmd(directory: str) -> None:
    """List the steps in DIRECTORY: complete or not, shards, size, and which is `latest`."""
    from rich.console import Console
    from rich.table import Table

    from unbroken.checkpoint.storage import disk

    _require_dir(directory)
    latest = disk.read_latest(directory)
    complete = set(disk.complete_steps(directory))
    table = Table("step", "status", "shards", "MB", "latest")
    for step in disk.list_steps(directory):
        shards = disk.committed_shards(directory, step)
        size = sum(os.path.getsize(os.path.join(p, f)) for p in shards.values() for f in os.listdir(p))
        table.add_row(
            str(step),
            "complete" if step in complete else "incomplete",
            ",".join(sorted(os.path.basename(p) for p in shards.values())),
            f"{size / 1e6:.1f}",
            "*" if step == latest else "",
        )
    Console().print(table)


@checkpoint.command()
@click.argument("directory")
@click.option("--step", type=int, default=None, help="Verify only this step (default: all).")
def verify(directory: str, step: int | None) -> None:
    """Read every shard and check every checksum; exits 1 if anything is damaged."""
    from unbroken.checkpoint.storage import disk

    _require_dir(directory)
    steps = disk.list_steps(directory) if step is None else [step]
    if step is not None and step not in disk.list_steps(directory):
        raise click.UsageError(f"step {step} is not in {directory}; see `unbroken checkpoint ls`")
    bad = 0
    for s in steps:
        shards = disk.committed_shards(directory, s)
        if s not in disk.complete_steps(directory):
            click.echo(f"step {s}: incomplete ({len(shards)} shard(s) committed)")
        for path in shards.values():
            try:
                disk.verify_shard(path)
                click.echo(f"step {s} {os.path.basename(path)}: ok")
            except (disk.CorruptCheckpoint, OSError, ValueError) as exc:
                bad += 1
                click.echo(f"step {s} {os.path.basename(path)}: DAMAGED: {exc}")
    if bad:
        raise SystemExit(1)


@checkpoint.command()
@click.argument("directory")
@click.option("--step", type=int, default=None, help="Step to export (default: newest complete).")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="The .safetensors file to write.")
def export(directory: str, step: int | None, out: str) -> None:
    """Export a step's tensors, whole (shards joined), to one safetensors file.

    Only tensors go into the file (safetensors holds nothing else); the non-tensor state stays
    in the checkpoint.
    """
    import torch
    from safetensors.torch import save_file

    from unbroken.checkpoint.storage import disk, restore
    from unbroken.checkpoint.storage.manifest import TensorSpec

    _require_dir(directory)
    complete = disk.complete_steps(directory)
    if step is None:
        if not complete:
            raise click.UsageError(f"{directory} holds no complete checkpoint")
        step = complete[0]
    elif step not in complete:
        raise click.UsageError(f"step {step} is not a complete checkpoint in {directory}")
    shards = restore.open_step(directory, step)
    want: dict[str, tuple[torch.Tensor, TensorSpec]] = {}
    for m in shards.manifests.values():
        for e in m.tensors:
            spec = TensorSpec(e.name, e.dtype, e.global_shape, e.global_shape, (0,) * len(e.global_shape))
            want.setdefault(e.name, (torch.empty(e.global_shape, dtype=getattr(torch, e.dtype)), spec))
    tensors = shards.read(want)
    save_file(tensors, out, metadata={"step": str(step), "source": os.path.abspath(directory)})
    click.echo(f"exported step {step}: {len(tensors)} tensors to {out}")


@checkpoint.command("serve-peer")
@click.option("--port", type=int, default=0, help="TCP port (0: any free port).")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to listen on: this node's address on the job's network for replicas on other "
    "nodes to push to (loopback serves this node only).",
)
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The job's secret file (default: $UNBROKEN_SECRET_FILE); only its holders may push or fetch.",
)
@click.option(
    "--max-gb",
    type=float,
    default=DEFAULT_MAX_BYTES / (1 << 30),
    show_default=True,
    help="The most memory the copies held (and arriving) may take.",
)
def serve_peer(port: int, host: str, secret_file: str | None, max_gb: float) -> None:
    """Keep peers' snapshots in this process's memory (prints the port, serves until killed)."""
    from unbroken.checkpoint.peer import serve
    from unbroken.wire.auth import JobSecret

    if not max_gb > 0:
        raise click.BadParameter(f"must be more than 0, got {max_gb}", param_hint="--max-gb")
    from unbroken.config import ConfigError

    try:
        secret = JobSecret.load(secret_file) if secret_file else JobSecret.required()
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    try:
        serve(secret, port, int(max_gb * (1 << 30)), host=host)
    except OSError as e:  # an address this machine does not have, a port in use
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
