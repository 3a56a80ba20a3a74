"""Runs a preset through both estimators and shapes the result for JSON and the terminal."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from rich.console import Group
from rich.table import Table

from unbroken.sim.interval import optimal_intervals
from unbroken.sim.measured import ASSUMPTIONS
from unbroken.sim.model import HOUR, closed_form
from unbroken.sim.montecarlo import simulate
from unbroken.sim.presets import Preset, Reproduction, max_restart_for
from unbroken.sim.sensitivity import replica_restart_for, swings

#: The projection's target (issue 31): ETTR at 100,000 GPUs.
ETTR_TARGET = 0.95


def _round(values: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 5) for key, value in values.items()}


def evaluate(
    preset: Preset, *, years: float = 1.0, runs: int = 20, seed: int = 0, intervals: bool = True
) -> dict[str, Any]:
    """Closed form, Monte Carlo, checkpoint intervals and targets for every policy of a preset."""
    cluster = preset.cluster
    policies: dict[str, Any] = {}
    for key, policy in preset.policies.items():
        estimate = closed_form(cluster, policy)
        sim = simulate(cluster, policy, years=years, runs=runs, seed=seed)
        entry: dict[str, Any] = {
            "ettr": round(sim.ettr, 5),
            "ettr_ci95": round(sim.ci95, 5),
            "ettr_closed_form": round(estimate.ettr, 5),
            "lost": _round(sim.lost),
            "lost_closed_form": _round(estimate.lost),
            "per_failure_s": {**policy.stall_s, **policy.degraded_s},
            "checkpoint_interval_s": round(estimate.checkpoint_interval_s, 3),
            "checkpoint_stall_s": policy.checkpoint_stall_s,
            "simulation_s": round(sim.elapsed_s, 3),
            "notes": list(policy.notes) if key != "unbroken" else [],
        }
        if intervals:
            entry["checkpoint"] = asdict(optimal_intervals(cluster, policy, seed=seed))
        target = preset.targets.get(key)
        if target is not None:
            entry["target"] = _judge(target, sim.ettr, sim.lost)
        policies[key] = entry
    result: dict[str, Any] = {
        "preset": preset.name,
        "title": preset.title,
        "gpus": cluster.gpus,
        "nodes": cluster.nodes,
        "replicas": cluster.replicas,
        "mtbf_min": round(60.0 / (cluster.event_rate_per_s * 3600.0), 3) if cluster.event_rate_per_s else None,
        "failures_per_day": round(cluster.event_rate_per_s * 24 * HOUR, 3),
        "policies": policies,
        "sources": list(preset.sources),
        "unbroken_figures": {k: {"value": f.value, "source": f.source} for k, f in preset.figures.items()},
        "assumptions": list(ASSUMPTIONS),
        "simulation": {"years_per_run": years, "runs": runs, "seed": seed},
    }
    if preset.reproductions:
        result["reproductions"] = [
            _reproduce(point, years=years, runs=runs, seed=seed) for point in preset.reproductions
        ]
    if preset.figures and "unbroken" in preset.policies:
        restart = replica_restart_for(cluster, preset.figures, ETTR_TARGET)
        result["sensitivity"] = {
            "swings": [
                {
                    "figure": w.name,
                    "value": w.value,
                    "kind": w.kind,
                    "ettr_half": round(w.ettr_half, 5),
                    "ettr_double": round(w.ettr_double, 5),
                }
                for w in swings(cluster, preset.figures)
            ],
            "target": ETTR_TARGET,
            "max_replica_restart_s_for_target": None if math.isnan(restart) else round(restart, 1),
        }
    if preset.name == "llama3":
        restart = max_restart_for(0.90, cluster, preset.policies["synchronous"])
        result["max_restart_min_for_90pct"] = None if math.isnan(restart) else round(restart / 60, 2)
    return result


def _reproduce(point: Reproduction, *, years: float, runs: int, seed: int) -> dict[str, Any]:
    sim = simulate(point.cluster, point.policy, years=years, runs=runs, seed=seed)
    estimate = closed_form(point.cluster, point.policy)
    return {
        "setting": point.label,
        "gpus": point.cluster.gpus,
        "mtbf_h": round(1.0 / point.cluster.event_rate_per_s / HOUR, 3),
        "checkpoint_interval_s": round(estimate.checkpoint_interval_s, 1),
        "published": point.published,
        "tolerance": point.tolerance,
        "ettr": round(sim.ettr, 5),
        "ettr_closed_form": round(estimate.ettr, 5),
        "source_formula": round(point.formula, 5),
        "met": abs(sim.ettr - point.published) <= point.tolerance,
        "source": point.source,
    }


def _judge(target: Any, ettr: float, lost: dict[str, float]) -> dict[str, Any]:
    if target.kind == "downtime":
        got = sum(v for k, v in lost.items() if k not in ("lost_work", "checkpoint_stall", "steady_overhead"))
        ok = abs(got - target.value) <= target.tolerance
    elif target.kind == "at_least":
        got, ok = ettr, ettr > target.value
    else:
        got, ok = ettr, abs(ettr - target.value) <= target.tolerance
    return {
        "kind": target.kind,
        "published": target.value,
        "tolerance": target.tolerance,
        "got": round(got, 5),
        "met": bool(ok),
        "source": target.source,
    }


def render(result: dict[str, Any]) -> Group:
    """Rich tables: ETTR per policy with its breakdown, then the preset's extras."""
    main = Table(title=f"{result['title']} — {result['gpus']:,} GPUs, a failure every " f"{result['mtbf_min']:.1f} min")
    main.add_column("policy")
    main.add_column("ETTR (MC ±95%)", justify="right")
    main.add_column("closed form", justify="right")
    main.add_column("target", justify="right")
    main.add_column("where the rest goes (share of wall time)")
    main.add_column("ckpt interval", justify="right")
    for name, entry in result["policies"].items():
        lost = sorted(((v, k) for k, v in entry["lost"].items() if v >= 0.0005), reverse=True)
        target = entry.get("target")
        target_text = (
            ""
            if target is None
            else (
                f"{'>' if target['kind'] == 'at_least' else ''}{target['published']:.1%} "
                f"{'ok' if target['met'] else 'MISSED'}"
            )
        )
        main.add_row(
            name,
            f"{entry['ettr']:.1%} ± {entry['ettr_ci95']:.2%}",
            f"{entry['ettr_closed_form']:.1%}",
            target_text,
            ", ".join(f"{k} {v:.1%}" for v, k in lost[:3]),
            f"{entry['checkpoint_interval_s'] / 60:.1f} min",
        )
    parts: list[Any] = [main]
    if "reproductions" in result:
        table = Table(title="Published points (synchronous restart from checkpoint)")
        for column in ("setting", "published", "ETTR (MC)", "closed form", "source's formula", ""):
            table.add_column(column, justify="right")
        for row in result["reproductions"]:
            table.add_row(
                row["setting"],
                f"{row['published']:.0%} ± {row['tolerance']:.0%}",
                f"{row['ettr']:.1%}",
                f"{row['ettr_closed_form']:.1%}",
                f"{row['source_formula']:.1%}",
                "ok" if row["met"] else "MISSED",
            )
        parts.append(table)
    if "sensitivity" in result:
        sens = result["sensitivity"]
        restart = sens["max_replica_restart_s_for_target"]
        title = "What moves the unbroken projection: ETTR (closed form) with each input halved / doubled"
        if restart is not None:
            title += f"; {sens['target']:.0%} needs a replica restart <= {restart / 60:.1f} min"
        table = Table(title=title)
        for column in ("input", "value", "", "halved", "doubled"):
            table.add_column(column, justify="right")
        for row in sens["swings"]:
            table.add_row(
                row["figure"],
                f"{row['value']:g}",
                row["kind"],
                f"{row['ettr_half']:.1%}",
                f"{row['ettr_double']:.1%}",
            )
        parts.append(table)
    figures = Table(title="unbroken figures (cluster-scale assumptions in --json 'assumptions')")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    figures.add_column("source")
    for name, fig in result["unbroken_figures"].items():
        figures.add_row(name, f"{fig['value']:g}", fig["source"])
    parts.append(figures)
    return Group(*parts)
