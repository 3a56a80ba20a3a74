"""ETTR against cluster size, one line per policy (closed form) with Monte Carlo points."""

from __future__ import annotations

from pathlib import Path

from unbroken.extras import require

matplotlib = require("matplotlib", "report", "unbroken simulate --plot")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from unbroken.sim.model import closed_form  # noqa: E402
from unbroken.sim.montecarlo import simulate  # noqa: E402
from unbroken.sim.presets import Preset  # noqa: E402

SIZES = (1024, 2048, 4096, 8192, 16_384, 32_768, 65_536, 100_000, 131_072, 262_144)


def ettr_by_size(
    preset: Preset, sizes: tuple[int, ...] = SIZES, *, seed: int = 0
) -> dict[str, list[tuple[int, float, float]]]:
    """Per policy: (GPUs, closed-form ETTR, Monte Carlo ETTR) at each size, failure rate per node kept."""
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for name, policy in preset.policies.items():
        points = []
        for gpus in sizes:
            cluster = preset.cluster.with_gpus(gpus)
            sim = simulate(cluster, policy, years=0.5, runs=3, seed=seed)
            points.append((gpus, closed_form(cluster, policy).ettr, sim.ettr))
        curves[name] = points
    return curves


def plot_ettr(preset: Preset, path: Path, *, seed: int = 0) -> Path:
    """Writes the PNG and returns its path."""
    curves = ettr_by_size(preset, seed=seed)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for (name, points), color in zip(curves.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False):
        gpus = np.array([p[0] for p in points])
        ax.plot(gpus, [100 * p[1] for p in points], color=color, label=f"{name} (closed form)")
        ax.scatter(gpus, [100 * p[2] for p in points], color=color, s=18, marker="o")
    ax.axvline(preset.cluster.gpus, color="grey", linestyle=":", linewidth=1)
    ax.text(preset.cluster.gpus, 3, f" {preset.name}\n {preset.cluster.gpus:,} GPUs", color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ticks = [s for s in SIZES if s != 131_072]  # its label would collide with 100K
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{s // 1024}K" if s % 1024 == 0 else f"{s / 1000:g}K" for s in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel("GPUs in the job (failure rate per node held constant)")
    ax.set_ylabel("effective training time ratio (%)")
    ax.set_title(f"ETTR against cluster size — preset {preset.name}\nlines: closed form, dots: Monte Carlo")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
