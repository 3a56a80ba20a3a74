"""unbroken's own figures, read from ``unbroken bench`` outputs and scaled to a cluster.

The benchmarks run on one machine (CPU processes, Gloo, a state of about a gigabyte). What
carries over to a cluster, and how, is stated in :data:`ASSUMPTIONS` and printed with every
projection; whatever a benchmark file does not provide falls back to the benchmark's target from
the issue that defines it (an upper bound, so the projection is not flattered by a missing file).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.sim.model import Policy

#: Share of failures that present as hangs (the rest as crashes that surface at once).
HANG_SHARE = 0.2
#: Per-GPU training state: a 405B-parameter model with bf16 weights, fp32 master copy and Adam
#: moments (16 bytes per parameter, 6.5 TB) sharded over one of 12 replicas of ~8,192 GPUs is
#: 0.8 GB per GPU; rounded up.
STATE_GIB_PER_GPU = 1.0
#: Rebuilding the cross-replica groups without ``rendezvous.json``: FT-HSDP reports "seconds,
#: not minutes"; 10 s is the fallback. Measured, it is one group's rebuild on its leader node's
#: store and that store serving the groups it leads (``rebuild_at_scale_s``): every leader node
#: serves only its own ranks' groups, so it does not grow with the job.
PG_REBUILD_S = 10.0
#: Restarting a failed replica (new node, containers, replica-internal init) is not something
#: unbroken measures; FT-HSDP's published 7 minutes is used, less its state load.
REPLICA_RESTART_S = 420.0
#: Checkpoints of a replica-level job only guard against losing every replica.
MIN_CHECKPOINT_INTERVAL_S = 1800.0
#: Without ``coordinator.json``: issue 20's target, 200 ms from a disconnect to the new epoch at
#: every survivor of 1,000 replica groups, grown linearly with the job.
REQUORUM_TARGET = ((1000.0, 0.2),)

ASSUMPTIONS: tuple[str, ...] = (
    f"{HANG_SHARE:.0%} of failures are hangs (detected by timeout), the rest crashes",
    f"per-GPU state {STATE_GIB_PER_GPU:g} GiB (405B params x 16 B over a ~8K-GPU replica); "
    "checkpoint stall and state load scale linearly from the benchmark's per-GiB figures, "
    "because every GPU snapshots and loads its own shard in parallel",
    "survivor stall = the benchmark's single-machine stall (crash or hang, weighted) + the groups' "
    "rebuild: the slowest rebuild of one group of 12 on its leader node's store plus that store "
    "serving the 8 groups it leads (`unbroken bench rendezvous` rebuild_at_scale_s; every leader node "
    "serves its own ranks' groups, so it does not grow with the job); Gloo on one machine: NCCL's "
    f"communicator init across 12 nodes is not measured ({PG_REBUILD_S:g} s assumed without the file)",
    f"replica restart (node, containers, init) = FT-HSDP's published {REPLICA_RESTART_S / 60:g} min; "
    "unbroken does not measure it",
    "catch-up: the rejoining replica is out for rejoin_steps more steps; survivors lose "
    "rejoin_steps x step x (donor_slowdown - 1) because the slowest donor paces the exchange",
    "steady overhead = overhead_ratio x record_overhead_ratio - 1 applies to every step",
    "a failure costs the survivors, besides the 3-replica stall, the measured disconnect-to-new-epoch "
    "time of `unbroken bench coordinator` at the job's GPU count (with --nodes: ranks through their "
    "node's connection; else a connection per rank); between measured sizes on the log-log line "
    "through the neighbours, beyond the largest growing at least linearly",
)


@dataclass(frozen=True)
class Figure:
    """One input figure and where it came from."""

    value: float
    source: str
    curve: tuple[tuple[float, float], ...] = ()  # (job size, value) points, for figures that scale


#: name -> (file, dotted key, fallback, unit); fallbacks are the issues' targets.
FIELDS: dict[str, tuple[str, str, float]] = {
    "crash_stall_s": ("recovery.json", "crash.survivor_stall_s", 1.0),
    "hang_stall_s": ("recovery.json", "hang.survivor_stall_s", 3.0),
    "rejoin_steps": ("recovery.json", "crash.rejoin_steps", 2.0),
    "donor_slowdown": ("recovery.json", "crash.donor_slowdown", 1.10),
    "overhead_ratio": ("recovery.json", "overhead_ratio", 1.05),
    "record_overhead_ratio": ("diagnosis.json", "record_overhead_ratio", 1.01),
    "diagnosis_s": ("diagnosis.json", "scenarios[].detect_s (mean over fault scenarios)", 2.0),
    "checkpoint_size_mb": ("checkpoint.json", "size_mb", 1024.0),
    "checkpoint_stall_s": ("checkpoint.json", "systems.unbroken.stall_s", 0.055),
    "checkpoint_durable_s": ("checkpoint.json", "systems.unbroken.durable_s", 4.5),
    "restore_memory_s": ("checkpoint.json", "systems.unbroken.restore_memory_s", 0.1),
    "pg_rebuild_s": ("rendezvous.json", "rebuild_at_scale_s", PG_REBUILD_S),
}


def _dig(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _load(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-run the benchmark or remove the file") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold one JSON object, found {type(data).__name__}")
    return data


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def read_figures(bench_dir: Path) -> dict[str, Figure]:
    """Every figure the projection needs, measured where a benchmark file provides it."""
    names = ("recovery.json", "checkpoint.json", "diagnosis.json", "rendezvous.json")
    files = {name: _load(bench_dir / name) for name in names}
    figures: dict[str, Figure] = {}
    for name, (file, key, fallback) in FIELDS.items():
        data = files[file]
        if name == "diagnosis_s":
            value = _mean_detect(data)
        else:
            value = _number(_dig(data, key)) if data is not None else None
        if value is None:
            figures[name] = Figure(fallback, f"default (target; {file} {key} not found)")
        else:
            figures[name] = Figure(value, f"measured: {bench_dir / file} {key}")
    figures["requorum_s"] = read_requorum(bench_dir)
    return figures


def read_requorum(bench_dir: Path) -> Figure:
    """Disconnect-to-new-epoch seconds against the job's GPU count, from ``coordinator.json``.

    The figure's value is the measured point of the largest size; :func:`at_size` reads the curve.
    """
    path = bench_dir / "coordinator.json"
    data = _load(path)
    rows = data.get("sizes") if data is not None else None
    points = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        # A run through node connections (--nodes) is read by its GPU (rank) count, a run of one
        # connection per rank by its connection count: both are the job's GPU count.
        size = _number(row.get("ranks", row.get("replica_groups")))
        ms = _number(row.get("disconnect_to_epoch_ms"))
        if size and ms is not None:
            points.append((size, ms / 1000.0))
    if not points:
        return Figure(
            REQUORUM_TARGET[-1][1],
            f"default (target: 200 ms at 1,000 groups, linear beyond; {path.name} "
            "sizes[].disconnect_to_epoch_ms not found)",
            REQUORUM_TARGET,
        )
    curve = tuple(sorted(points))
    return Figure(curve[-1][1], f"measured: {path} sizes[].disconnect_to_epoch_ms", curve)


def at_size(figure: Figure, size: float) -> float:
    """``figure`` at job size ``size``: its curve read on log-log axes (the value if it has none).

    Between two measured sizes: the power law through them. Beyond the largest: the slope of the
    last two points, but never below linear (each survivor must be answered). Below the
    smallest: the smallest size's value (a fixed cost does not shrink).
    """
    curve = [(x, y) for x, y in figure.curve if x > 0 and y > 0]
    if not curve:
        return figure.value
    if size <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if size <= x1:
            slope = math.log(y1 / y0) / math.log(x1 / x0)
            return y0 * (size / x0) ** slope
    (x0, y0), (x1, y1) = curve[-2] if len(curve) > 1 else curve[-1], curve[-1]
    slope = math.log(y1 / y0) / math.log(x1 / x0) if x1 > x0 else 1.0
    return y1 * (size / x1) ** max(1.0, slope)


def _mean_detect(data: dict[str, Any] | None) -> float | None:
    if data is None or not isinstance(data.get("scenarios"), list):
        return None
    found = [_number(s.get("detect_s")) for s in data["scenarios"] if isinstance(s, dict) and not s.get("clean", False)]
    values = [v for v in found if v is not None]
    return sum(values) / len(values) if values else None


def unbroken_policy(
    figures: dict[str, Figure],
    step_s: float,
    gpus: int | None = None,
    replica_restart_s: float = REPLICA_RESTART_S,
) -> Policy:
    """The unbroken recovery design at cluster scale, from benchmark figures.

    ``gpus``: the job's size, at which the coordinator's re-quorum time is read (one connection
    per GPU); None leaves that term out (the 3-replica figures alone). ``replica_restart_s``: the
    one assumed (unmeasured) cost, given to vary it.
    """
    f = {name: fig.value for name, fig in figures.items()}
    pg_rebuild_s = f.get("pg_rebuild_s", PG_REBUILD_S)
    stall = {"detection": (1 - HANG_SHARE) * f["crash_stall_s"] + HANG_SHARE * f["hang_stall_s"]}
    if gpus is not None and "requorum_s" in figures:
        stall[f"coordinator re-quorum at {gpus:,} GPUs"] = at_size(figures["requorum_s"], gpus)
    stall["pg_rebuild"] = pg_rebuild_s
    per_gib = STATE_GIB_PER_GPU / (f["checkpoint_size_mb"] / 1024.0 or 1.0)
    rejoin_steps = f["rejoin_steps"]
    state_load = f["restore_memory_s"] * per_gib
    return Policy(
        name="unbroken",
        replica_level=True,
        stall_s=stall,
        degraded_s={
            "diagnosis": HANG_SHARE * f["diagnosis_s"],
            "replica_restart": replica_restart_s,
            "state_load": state_load,
            "catch_up_steps": rejoin_steps * step_s,
        },
        rejoin_stall_s=rejoin_steps * step_s * max(0.0, f["donor_slowdown"] - 1.0),
        checkpoint_interval_s=max(MIN_CHECKPOINT_INTERVAL_S, f["checkpoint_durable_s"] * per_gib),
        checkpoint_stall_s=f["checkpoint_stall_s"] * per_gib,
        steady_overhead=max(0.0, f["overhead_ratio"] * f["record_overhead_ratio"] - 1.0),
        notes=ASSUMPTIONS,
    )
