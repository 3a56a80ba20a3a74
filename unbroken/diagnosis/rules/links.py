"""The connection matrix: which node or link makes transfers slow (C4D).

Cells hold the time per megabyte of transfers from a sender to a receiver, each measured only
when the receiver was already waiting for it (from the send's post to the receive's
completion): the connection was then the only thing between the data and its reader. An idle
connection, or one whose receiver is late because it is busy, gives no samples and is never
called slow.

A cell joins two clocks: the sender's post and the receiver's completion, each mapped to the
coordinator's clock with an offset good to a fraction of a millisecond, the length of a whole
transfer. Measured in clean ring runs on 2 shared cores: one direction of a link read 0.35 ms/MB
slow and the other as much fast (clipped at zero), and the fastest cells, made the reference,
put every other cell at 4-14x: false ``comm_slow`` verdicts naming a healthy node or link. The
two directions of a link carry opposite errors, so the rules judge *links*: a link's figures
are the sums over its two directions of a low and a high quantile of their samples, in which
the clock error cancels. Sender and receiver cannot be told apart that way; a slow node (every
link of one member slow) and a slow link can, and those are the two patterns named.

The evidence a verdict needs: a link is slow when its low figure (the fastest quarter of its
transfers: scheduling on a busy host only ever *adds* delay to some of them, while a slow wire
slows every transfer, the fastest included) is ``ratio`` times the *high* figure (slowest
quarter) of the reference links, the fastest third (a slow node spoils two of the three links
of a 3-member ring, so the reference comes from those it leaves alone). Comparing the slow
link's floor with the healthy links' upper quartile puts the machine's own noise in the
threshold. Measured on 2 shared cores, with and without a CPU hog
(docs/benchmarks/2026-11-29-diagnosis-rates.md): a healthy link's score (low figure over the
reference's high one) peaked at 1.23 over ~1100 evaluations; a 60 MB/s link scored 17-25 once
its window held the fault. ``ratio`` 2.5 sits 2x above the worst healthy score and 7x below
the fault.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from unbroken.diagnosis.robust import quantile_of

Cell = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class LinkFinding:
    pattern: str  # "node" or "link"
    replica: int
    link: Cell | None
    slow_cells: tuple[Cell, ...]
    evidence: dict[str, Any]


CELL_QUANTILE = 0.25
HIGH_QUANTILE = 0.75


def link_figures(
    cells: Mapping[Cell, Sequence[float]], min_samples: int, low: float = CELL_QUANTILE, high: float = HIGH_QUANTILE
) -> dict[Cell, tuple[float, float]]:
    """(low, high) figure per link ``(a, b)``, ``a < b``, whose two directions both have
    ``min_samples`` samples: the sums of the directions' ``low`` and ``high`` quantiles."""
    out = {}
    for (a, b), xs in cells.items():
        back = cells.get((b, a))
        if a < b and back is not None and len(xs) >= min_samples and len(back) >= min_samples:
            out[(a, b)] = (
                quantile_of(xs, low) + quantile_of(back, low),
                quantile_of(xs, high) + quantile_of(back, high),
            )
    return out


def reference_high(figs: Mapping[Cell, tuple[float, float]]) -> float | None:
    """The median high figure of the fastest third of the links (by low figure), or None when
    fewer than two links are known or it is not positive (no healthy scale to judge by)."""
    if len(figs) < 2:
        return None
    refs = sorted(figs, key=lambda k: figs[k][0])[: max(1, math.ceil(len(figs) / 3))]
    ref = float(np.median([figs[k][1] for k in refs]))
    return ref if ref > 0 else None


def link_scores(
    cells: Mapping[Cell, Sequence[float]], min_samples: int = 8, quantile: float = CELL_QUANTILE
) -> dict[Cell, float]:
    """Each known link's score: its low figure over the reference links' high figure (what
    :func:`classify_slow` compares with ``ratio``); empty when no reference can be taken."""
    figs = link_figures(cells, min_samples, quantile, HIGH_QUANTILE)
    ref = reference_high(figs)
    return {} if ref is None else {k: lo / ref for k, (lo, _) in figs.items()}


def classify_slow(
    cells: Mapping[Cell, Sequence[float]],
    ratio: float = 2.5,
    min_samples: int = 8,
    quantile: float = CELL_QUANTILE,
    high: float = HIGH_QUANTILE,
) -> LinkFinding | None:
    """The slow node or link in the matrix, or None when the links agree (or too few are known)."""
    if ratio <= 1.0 or not 0.0 <= quantile <= high <= 1.0 or min_samples < 1:
        raise ValueError(
            f"need ratio > 1, 0 <= quantile <= high <= 1 and min_samples >= 1; got ratio={ratio}, "
            f"quantile={quantile}, high={high}, min_samples={min_samples}"
        )
    figs = link_figures(cells, min_samples, quantile, high)
    ref = reference_high(figs)
    if ref is None:
        return None
    slow = {k for k, (lo, _) in figs.items() if lo >= ratio * ref}
    if not slow or len(slow) == len(figs):
        return None
    evidence = {
        "links_s_per_mb": {f"{a}-{b}": [round(lo, 5), round(hi, 5)] for (a, b), (lo, hi) in sorted(figs.items())},
        "reference_high_s_per_mb": round(ref, 5),
        "scores": {f"{a}-{b}": round(figs[(a, b)][0] / ref, 2) for a, b in sorted(figs)},
        "quantiles": [quantile, high],
        "ratio": ratio,
        "slow_links": [f"{a}-{b}" for a, b in sorted(slow)],
    }
    slow_cells = tuple(sorted(c for a, b in slow for c in ((a, b), (b, a))))
    for n in sorted({n for k in figs for n in k}):
        touching = {k for k in figs if n in k}
        if len(touching) > 1 and touching == slow:
            return LinkFinding("node", n, None, slow_cells, evidence)
    if len(slow) == 1:
        a, b = next(iter(slow))
        # Which end sends the slower direction is not known (the clock errors); name both ends.
        return LinkFinding("link", a, (a, b), slow_cells, evidence)
    return None


@dataclasses.dataclass(frozen=True)
class PortFinding:
    """A NIC port whose connection to a peer keeps failing: a link verdict naming the port.

    ``host`` and ``interface`` are the sender's (the ICCL ring names its own side of each hop),
    ``peer`` the replica (ring rank) at the other end.
    """

    state: str  # "failing": down once in the window; "flapping": down again and again
    host: str
    interface: str
    peer: int
    failures: int
    first_t: float
    last_t: float
    why: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"class": "link"}


def port_findings(
    events: Sequence[Mapping[str, Any]], now: float, window_s: float = 30.0, flap_at: int = 2
) -> list[PortFinding]:
    """The ports with a ``down`` event in the last ``window_s``: ``flapping`` at ``flap_at`` or more.

    ``events`` are path events as the ICCL ring logs them (``t``, ``host``, ``interface``, ``peer``,
    ``what``, ``why``); anything else in the list is ignored.
    """
    if window_s <= 0 or flap_at < 2:
        raise ValueError(f"need window_s > 0 and flap_at >= 2, got {window_s}, {flap_at}")
    downs: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    for e in events:
        if e.get("what") == "down" and now - window_s <= e.get("t", -math.inf) <= now:
            downs.setdefault((str(e.get("host")), str(e.get("interface")), int(e.get("peer", -1))), []).append(e)
    out = []
    for (host, iface, peer), es in sorted(downs.items()):
        es = sorted(es, key=lambda e: e["t"])
        state = "flapping" if len(es) >= flap_at else "failing"
        out.append(PortFinding(state, host, iface, peer, len(es), es[0]["t"], es[-1]["t"], str(es[-1].get("why", ""))))
    return out
