"""The connection matrix: which node or link makes transfers slow (C4D).

Cells hold the time per megabyte of transfers from a sender to a receiver, from the later of
the send's and the receive's posts to the receive's completion, less the receiving thread's
wait for a CPU (:func:`transfer_time`): the connection was then the only thing between the
data and its reader. An idle connection gives no samples and is never called slow.

A transfer the receiver awaited joins two clocks: the sender's post and the receiver's
completion, each mapped to the coordinator's clock by the smallest telemetry delay seen, which
is milliseconds off early in a job and a fraction of one later: as long as a whole transfer.
Each transfer is kept on its ends' own clocks and read with the offsets known when it is judged,
and each pair's clocks are reconciled from its own fastest transfers both ways
(:func:`clock_corrections`). The rules judge *links*: a link's figures are the sums over its two
directions of a low and a high quantile of their samples, in which what clock error is left
cancels. Sender and receiver cannot be told apart that way; a slow node (every link of one member
slow) and a slow link can, and those are the two patterns named.

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

A link whose one direction has too few samples (its awaited transfers cannot be read until the
pair's clocks are reconciled, which needs awaited transfers both ways: a slow node's peers are
late in every receive from it, so its links may go 30 collectives without) is judged by the
other direction alone, against half the reference (a direction is about half a link's
figure), at :data:`ONE_WAY_FACTOR` times the ratio: whatever clock error is left does not
cancel in one direction, so it must clear twice the bar a whole link does, 5x its healthy
counterpart. A 20 Mbit/s direction reads 100x or more. A lone direction is never the reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from unbroken.diagnosis.robust import quantile_of

Cell = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class TransferTimes:
    """One transfer as its two ends saw it, each on its own clock: read with the offsets the
    master knows *when it judges*, not when the transfer arrived. Offsets are the smallest
    telemetry delay seen so far; early in a job they are milliseconds off (measured in the box:
    8.6, 1.2 and 8.5 ms for three ranks after 15 collectives, within 0.8 ms of each other after
    90), and a sample mapped then kept that error in its cell (healthy links read -40 ms/MB)."""

    sender: tuple[int, int]  # (replica, rank)
    receiver: tuple[int, int]
    send_post: float
    recv_post: float
    recv_done: float
    recv_queued: float  # the receiving thread's wait for a CPU between its post and done
    mb: float


def transfer_time(t: TransferTimes, send_offset: float, recv_offset: float, correction: float | None) -> float | None:
    """The transfer's time on the wire, in seconds per MB, each end's clock mapped by its
    offset; None for an awaited transfer whose pair's clocks are not reconciled yet.

    *Late* (the receiver posted after the sender; it was still busy): from its own post, on its
    own clock, with no clock error; what had not arrived yet still crossed the wire while it
    waited, so this is a floor of the wire's time. Dropping late transfers starved a slow link of
    samples: its receivers are always late, still in their own slow transfers (in the box with
    ``tbf`` on one host its cells went 50 collectives without enough, and no verdict came).
    *Awaited* (the receiver posted first): from the sender's post to the receive's completion,
    across two clocks, the sender's moved by the pair's ``correction``
    (:func:`clock_corrections`); without one, the clock error (milliseconds, against a healthy
    transfer's half millisecond) would not cancel beside late transfers, which carry none.
    Either way only the receiving thread's wait for a CPU that can have fallen after the
    transfer began is the machine's and is taken off: a receiver preempted before the sender
    posted waited for nothing.
    """
    send_post = t.send_post + send_offset
    recv_post, recv_done = t.recv_post + recv_offset, t.recv_done + recv_offset
    if recv_post > send_post:
        start = recv_post
    elif correction is None:
        return None
    else:
        start = send_post + correction
    queued_after = max(0.0, t.recv_queued - max(0.0, start - recv_post))
    return (recv_done - start - queued_after) / t.mb


def clock_corrections(
    samples: Iterable[TransferTimes], offsets: Mapping[tuple[int, int], float]
) -> dict[tuple[tuple[int, int], tuple[int, int]], float]:
    """Per (sender, receiver) pair, what to add to the sender's offset so that both ends read
    one clock, estimated from the transfers themselves (NTP's symmetric assumption).

    Offsets are the smallest telemetry delay seen, good only to that delay: measured in the box
    (one kernel, so the true offsets are equal) they stood 2.4, 2.4 and 0.95 ms, a 1.5 ms error
    between two ranks against a healthy transfer's 0.5 ms. A transfer the receiver awaited reads
    ``wire + e`` one way and ``wire - e`` the other; the fastest of each way differ by ``2e``.
    The link's two directions summed do not depend on it; a direction alone, or a receiver
    timed from its own post (no ``e`` at all) beside one timed from the sender's, does. A pair
    without awaited transfers both ways gets no entry, and its awaited transfers are not read
    (:func:`transfer_time`).

    The master reads samples through :class:`~unbroken.diagnosis.rules.link_samples.LinkSamples`,
    which computes the same in one vectorized pass; this is its plain statement, which the unit
    tests compare it with.
    """
    fastest: dict[tuple[tuple[int, int], tuple[int, int]], float] = {}
    for t in samples:
        if t.sender not in offsets or t.receiver not in offsets:
            continue
        send_post, recv_post = t.send_post + offsets[t.sender], t.recv_post + offsets[t.receiver]
        if recv_post <= send_post:  # awaited: the sender's post started the transfer
            pair = (t.sender, t.receiver)
            x = t.recv_done + offsets[t.receiver] - send_post
            fastest[pair] = min(fastest.get(pair, math.inf), x)
    return {(a, b): (x - fastest[(b, a)]) / 2 for (a, b), x in fastest.items() if (b, a) in fastest}


class CellTimes(Mapping[Cell, np.ndarray]):
    """Each cell's transfer times (seconds per MB), as :class:`~unbroken.diagnosis.rules.link_samples.LinkSamples`
    reads them: one row per cell, NaN in unused slots. A mapping of cell to its times, as the
    rules take; its quantiles and stall counts are computed for all cells at once, and the
    quantiles kept, since the rules ask for the same ones several times per judgement."""

    def __init__(self, cells: Sequence[Cell], values: np.ndarray, stall_values: np.ndarray | None = None) -> None:
        xs = np.sort(values, axis=1)  # NaN last
        n = (~np.isnan(xs)).sum(axis=1)
        keep = n > 0  # a cell without a readable transfer is not known (as a plain mapping leaves it out)
        self._cells = [c for c, k in zip(cells, keep, strict=True) if k]
        self._sorted, self._n = xs[keep], n[keep]
        # Stalls are counted over a longer window when one is given (LinkSamples' ``window``).
        self._stall_values = self._sorted if stall_values is None else stall_values[keep]
        self._index = {c: i for i, c in enumerate(self._cells)}
        self._quantiles: dict[float, dict[Cell, float]] = {}

    def __getitem__(self, cell: Cell) -> np.ndarray:
        i = self._index[cell]
        return self._sorted[i, : self._n[i]]

    def __iter__(self) -> Iterator[Cell]:
        return iter(self._cells)

    def __len__(self) -> int:
        return len(self._cells)

    def sizes(self) -> dict[Cell, int]:
        return dict(zip(self._cells, self._n.tolist(), strict=True))

    def quantiles(self, q: float) -> dict[Cell, float]:
        """:func:`quantile_of` of every cell, computed at once."""
        got = self._quantiles.get(q)
        if got is None:
            if not self._cells:
                return {}
            pos = q * (self._n - 1)
            lo = pos.astype(np.int64)
            hi = np.minimum(lo + 1, self._n - 1)
            rows = np.arange(len(self._cells))
            a, b = self._sorted[rows, lo], self._sorted[rows, hi]
            got = self._quantiles[q] = dict(zip(self._cells, (a + (b - a) * (pos - lo)).tolist(), strict=True))
        return got

    def count_at_least(self, threshold: float) -> dict[Cell, int]:
        with np.errstate(invalid="ignore"):
            counts = (self._stall_values >= threshold).sum(axis=1)
        return dict(zip(self._cells, counts.tolist(), strict=True))


# The rules take a plain mapping (tests, calibration) or the master's vectorized read.
Times = Mapping[Cell, Sequence[float]] | CellTimes


def _sizes(cells: Times) -> dict[Cell, int]:
    return cells.sizes() if isinstance(cells, CellTimes) else {k: len(xs) for k, xs in cells.items()}


def _quantiles(cells: Times, q: float, of: Iterable[Cell]) -> dict[Cell, float]:
    """``q`` quantile of the cells ``of``: all at once from a :class:`CellTimes`."""
    if isinstance(cells, CellTimes):
        got = cells.quantiles(q)
        return {k: got[k] for k in of}
    return {k: quantile_of(cells[k], q) for k in of}


def _count_at_least(cells: Times, threshold: float) -> dict[Cell, int]:
    if isinstance(cells, CellTimes):
        return cells.count_at_least(threshold)
    return {k: sum(1 for x in xs if x >= threshold) for k, xs in cells.items()}


@dataclasses.dataclass(frozen=True)
class LinkFinding:
    pattern: str  # "node" or "link"
    replica: int
    link: Cell | None
    slow_cells: tuple[Cell, ...]
    evidence: dict[str, Any]
    cause: str = "slow"  # "slow": its fastest transfers are; "stalling": some wait out retransmissions


CELL_QUANTILE = 0.25
HIGH_QUANTILE = 0.75
ONE_WAY_FACTOR = 2.0


def link_figures(
    cells: Times, min_samples: int, low: float = CELL_QUANTILE, high: float = HIGH_QUANTILE
) -> dict[Cell, tuple[float, float]]:
    """(low, high) figure per link ``(a, b)``, ``a < b``, whose two directions both have
    ``min_samples`` samples: the sums of the directions' ``low`` and ``high`` quantiles."""
    n = _sizes(cells)
    both = [(a, b) for a, b in n if a < b and n[(a, b)] >= min_samples and n.get((b, a), 0) >= min_samples]
    of = both + [(b, a) for a, b in both]
    lo, hi = _quantiles(cells, low, of), _quantiles(cells, high, of)
    return {(a, b): (lo[(a, b)] + lo[(b, a)], hi[(a, b)] + hi[(b, a)]) for a, b in both}


def one_way_figures(cells: Times, min_samples: int, low: float = CELL_QUANTILE) -> dict[Cell, tuple[float, Cell]]:
    """Per link ``(a, b)``, ``a < b``, known in one direction only (that direction has
    ``min_samples`` samples, the other fewer): the direction's ``low`` quantile and the direction."""
    n = _sizes(cells)
    alone = [(src, dst) for src, dst in n if n[(src, dst)] >= min_samples and n.get((dst, src), 0) < min_samples]
    lo = _quantiles(cells, low, alone)
    return {(min(src, dst), max(src, dst)): (lo[(src, dst)], (src, dst)) for src, dst in alone}


def reference_high(figs: Mapping[Cell, tuple[float, float]]) -> float | None:
    """The median high figure of the fastest third of the links (by low figure), or None when
    no link is known or it is not positive (no healthy scale to judge by). One link is enough: a
    link is never slow against its own high figure, but directions judged alone may be (a slow
    node of a 3-member ring leaves one link whole)."""
    if not figs:
        return None
    refs = sorted(figs, key=lambda k: figs[k][0])[: max(1, math.ceil(len(figs) / 3))]
    ref = float(np.median([figs[k][1] for k in refs]))
    return ref if ref > 0 else None


def link_scores(cells: Times, min_samples: int = 8, quantile: float = CELL_QUANTILE) -> dict[Cell, float]:
    """Each known link's score: its low figure over the reference links' high figure (what
    :func:`classify_slow` compares with ``ratio``); empty when no reference can be taken."""
    figs = link_figures(cells, min_samples, quantile, HIGH_QUANTILE)
    ref = reference_high(figs)
    return {} if ref is None else {k: lo / ref for k, (lo, _) in figs.items()}


def one_way_scores(cells: Times, min_samples: int = 8, quantile: float = CELL_QUANTILE) -> dict[Cell, float]:
    """Each direction judged alone (see :func:`one_way_figures`), keyed by ``(src, dst)``: its low
    figure over half the two-way links' reference (compared with ``ONE_WAY_FACTOR * ratio``)."""
    ref = reference_high(link_figures(cells, min_samples, quantile, HIGH_QUANTILE))
    if ref is None:
        return {}
    return {d: 2 * lo / ref for lo, d in one_way_figures(cells, min_samples, quantile).values()}


def classify_slow(
    cells: Times,
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
    lone = one_way_figures(cells, min_samples, quantile)
    known = set(figs) | set(lone)
    slow = {k for k, (lo, _) in figs.items() if lo >= ratio * ref}
    slow |= {k for k, (lo, _) in lone.items() if 2 * lo >= ONE_WAY_FACTOR * ratio * ref}
    if not slow or len(slow) == len(known):
        return None
    evidence = {
        "links_s_per_mb": {f"{a}-{b}": [round(lo, 5), round(hi, 5)] for (a, b), (lo, hi) in sorted(figs.items())},
        "reference_high_s_per_mb": round(ref, 5),
        "scores": {f"{a}-{b}": round(figs[(a, b)][0] / ref, 2) for a, b in sorted(figs)},
        "one_way_scores": {f"{s}>{d}": round(2 * lo / ref, 2) for lo, (s, d) in (lone[k] for k in sorted(lone))},
        "quantiles": [quantile, high],
        "ratio": ratio,
        "one_way_ratio": ONE_WAY_FACTOR * ratio,
        "slow_links": [f"{a}-{b}" for a, b in sorted(slow)],
    }
    return _pattern(known, slow, evidence, "slow")


def _pattern(known: set[Cell], bad: set[Cell], evidence: dict[str, Any], cause: str) -> LinkFinding | None:
    """Every known link of one member bad: that member's node; one link alone: that link (by
    both ends: which one sends the worse direction is not known); anything else: nobody."""
    cells = tuple(sorted(c for a, b in bad for c in ((a, b), (b, a))))
    for n in sorted({n for k in known for n in k}):
        touching = {k for k in known if n in k}
        if len(touching) > 1 and touching == bad:
            return LinkFinding("node", n, None, cells, evidence, cause)
    if len(bad) == 1:
        a, b = next(iter(bad))
        return LinkFinding("link", a, (a, b), cells, evidence, cause)
    return None


def same_evidence(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    """Whether two findings' signatures, ``(pattern, culprit, cause)`` with culprit a node's
    replica or a link's frozenset of ends, name the same fault: equal, or a node and one of its
    own links with the same cause."""
    if a is None or b is None or a == b:
        return a == b
    if a[2] != b[2] or {a[0], b[0]} != {"node", "link"}:
        return False
    node, link = (a[1], b[1]) if a[0] == "node" else (b[1], a[1])
    return node in link


STALL_FACTOR = 100.0
MIN_STALLS = 2


def classify_stalling(
    cells: Times,
    min_samples: int = 8,
    quantile: float = CELL_QUANTILE,
    factor: float = STALL_FACTOR,
    min_stalls: int = MIN_STALLS,
) -> LinkFinding | None:
    """The node or link whose transfers *stall*: a lossy link (a failing cable or optic).

    TCP recovers most drops within a round trip, so a lossy link's fastest transfers stay
    healthy and :func:`classify_slow`, which judges floors, is silent; some transfers wait a
    retransmission timeout. Measured in the box with 5% of one host's packets dropped: its cells
    held 0.2-0.65 s stalls of a 0.18 MB transfer, 500-1500x a healthy direction's floor, one or
    two in each 16, while the job ran 2.8x slower. Over 10 clean box runs (11,871 transfers) the
    worst was 36x the floor (p99.9 18x). A stall is ``factor`` (100) times the median floor of
    the known cells; a link stalls with ``min_stalls`` of them in its window (both directions),
    and only while some known link has none. From a :class:`CellTimes` with a stall window
    (the master's: 64 transfers a direction, against the rules' 16), stalls are counted over
    that longer window: counted over 16, two stalls seldom met, and the finding came and went
    before it could hold for its confirmation (18 of 20 box runs named within 30 steps).
    """
    if factor <= 1.0 or min_stalls < 1 or min_samples < 1:
        raise ValueError(
            f"need factor > 1, min_stalls >= 1, min_samples >= 1; got {factor}, {min_stalls}, {min_samples}"
        )
    n = _sizes(cells)
    floors = list(_quantiles(cells, quantile, [k for k, m in n.items() if m >= min_samples]).values())
    if len(floors) < 2:
        return None
    scale = float(np.median(floors))
    if scale <= 0:
        return None
    counts: dict[Cell, int] = {}
    sizes: dict[Cell, int] = {}
    for (a, b), stalls in _count_at_least(cells, factor * scale).items():
        link = (min(a, b), max(a, b))
        sizes[link] = sizes.get(link, 0) + n[(a, b)]
        counts[link] = counts.get(link, 0) + stalls
    known = {k for k, n in sizes.items() if n >= min_samples}
    bad = {k for k in known if counts[k] >= min_stalls}
    if not bad or len(bad) == len(known):
        return None
    evidence = {
        "stalls": {f"{a}-{b}": counts[(a, b)] for a, b in sorted(known)},
        "floor_s_per_mb": round(scale, 5),
        "stall_factor": factor,
        "min_stalls": min_stalls,
        "stalling_links": [f"{a}-{b}" for a, b in sorted(bad)],
    }
    return _pattern(known, bad, evidence, "stalling")


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
