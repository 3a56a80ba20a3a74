"""The connection matrix: which sender, receiver or link makes transfers slow (C4D).

Cells hold the time per megabyte of transfers from a sender to a receiver, each measured only
when the receiver was already waiting for it (from the send's post to the receive's
completion): the connection was then the only thing between the data and its reader. An idle
connection, or one whose receiver is late because it is busy, gives no samples and is never
called slow. A cell's figure is a low quantile of
its recent samples (:data:`CELL_QUANTILE`): scheduling on a busy host only ever *adds* delay to
some transfers (measured on 2 shared cores: medians spread 2-3x between healthy cells, fastest
quarters 1.3x), while a slow wire raises every transfer, the fastest included. Against a
reference (the median of the fastest third of the cells: a slow node spoils two thirds of a
3-member matrix, so the reference must come from the cells it leaves alone), a cell is slow when it
is ``ratio`` times the reference. The pattern of slow cells names the culprit: a whole row and
column is a slow node; a row alone a slow sender; a column alone a slow receiver; the cells
of one pair a slow link.
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
    pattern: str  # "node", "sender", "receiver" or "link"
    replica: int
    link: Cell | None
    slow_cells: tuple[Cell, ...]
    evidence: dict[str, Any]


CELL_QUANTILE = 0.25


def cell_floors(cells: Mapping[Cell, Sequence[float]], min_samples: int, q: float = CELL_QUANTILE) -> dict[Cell, float]:
    """Each cell's low quantile, for cells with at least ``min_samples`` samples."""
    return {c: quantile_of(xs, q) for c, xs in cells.items() if len(xs) >= min_samples}


def classify_slow(
    cells: Mapping[Cell, Sequence[float]], ratio: float = 3.0, min_samples: int = 8, quantile: float = CELL_QUANTILE
) -> LinkFinding | None:
    """The slow node, sender, receiver or link in the matrix, or None when all cells agree."""
    if ratio <= 1.0 or not 0.0 <= quantile <= 1.0 or min_samples < 1:
        raise ValueError(
            f"need ratio > 1, 0 <= quantile <= 1 and min_samples >= 1; got ratio={ratio}, "
            f"quantile={quantile}, min_samples={min_samples}"
        )
    meds = cell_floors(cells, min_samples, quantile)
    if len(meds) < 2:
        return None
    fastest = sorted(meds.values())[: max(1, math.ceil(len(meds) / 3))]
    ref = float(np.median(fastest))
    slow = {c for c, m in meds.items() if m >= ratio * ref}
    if not slow or len(slow) == len(meds):
        return None
    nodes = sorted({n for c in meds for n in c})
    evidence = {
        "matrix_s_per_mb": {f"{a}->{b}": round(m, 5) for (a, b), m in sorted(meds.items())},
        "reference_s_per_mb": round(ref, 5),
        "cell_quantile": quantile,
        "ratio": ratio,
        "slow_cells": [f"{a}->{b}" for a, b in sorted(slow)],
    }

    def row(n: int) -> set[Cell]:
        return {c for c in meds if c[0] == n}

    def col(n: int) -> set[Cell]:
        return {c for c in meds if c[1] == n}

    slow_t = tuple(sorted(slow))
    for n in nodes:
        if row(n) and col(n) and row(n) | col(n) == slow:
            return LinkFinding("node", n, None, slow_t, evidence)
    for n in nodes:
        if len(row(n)) > 1 and row(n) == slow:
            return LinkFinding("sender", n, None, slow_t, evidence)
        if len(col(n)) > 1 and col(n) == slow:
            return LinkFinding("receiver", n, None, slow_t, evidence)
    pairs = {tuple(sorted(c)) for c in slow}
    if len(pairs) == 1:
        a, b = max(slow, key=lambda c: meds[c])  # the slower direction names the sender
        return LinkFinding("link", a, (a, b), slow_t, evidence)
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
