"""The connection matrix's samples, kept in arrays and read in one vectorized pass.

The coordinator judges links at every collective, reading each cell's transfers with the clock
offsets known *then* (:class:`~unbroken.diagnosis.rules.links.TransferTimes`). Read one sample
at a time in Python, that cost 26 ms of the coordinator's event loop per collective at 512
replicas on a ring (16 samples in each of 1,024 cells, three Python passes); held here as one
array per field, a read is a handful of numpy operations over all samples at once and gives the
same numbers as :func:`~unbroken.diagnosis.rules.links.clock_corrections` and
:func:`~unbroken.diagnosis.rules.links.transfer_time` (a unit test compares them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from unbroken.diagnosis.rules.links import Cell, CellTimes, TransferTimes, transfer_time

Ident = tuple[int, int]  # (replica, rank)
_FIELDS = ("send_post", "recv_post", "recv_done", "recv_queued", "mb")


class LinkSamples:
    """The last ``window`` transfers of each (sender, receiver) replica cell, as arrays.

    Each cell owns a row of ``window`` slots, filled as a ring; rows and rank indices of a
    forgotten replica are reused, so the store holds at most one row per live cell. The rules'
    quantiles read the newest ``recent`` transfers (default: all ``window``), exactly. Stalls are
    counted over all ``window`` (:func:`~unbroken.diagnosis.rules.links.classify_stalling`): a
    lossy link stalls one or two transfers in 16, and counted over 16 the finding came and went
    before it could hold. They are counted on each transfer's time as read when it came (the
    offsets then, its pair's clocks not reconciled): a stall is 100x a healthy floor, and
    that reading is off by the clock error, milliseconds at worst; reading 64 transfers a cell
    exactly at every collective cost the coordinator nearly twice the time of reading 16.
    """

    def __init__(self, window: int, recent: int | None = None) -> None:
        recent = window if recent is None else recent
        if not 1 <= recent <= window:
            raise ValueError(f"need 1 <= recent <= window transfers, got recent={recent}, window={window}")
        self.window = window
        self.recent = recent
        self._rows: dict[Cell, int] = {}
        self._free_rows: list[int] = []
        self._idents: dict[Ident, int] = {}
        self._free_idents: list[int] = []
        cap = 8
        self._f = {name: np.zeros((cap, window)) for name in _FIELDS}
        self._as_read = np.full((cap, window), np.nan)  # each transfer's time when it came (for stalls)
        self._sender = np.zeros((cap, window), dtype=np.int64)
        self._receiver = np.zeros((cap, window), dtype=np.int64)
        self._count = np.zeros(cap, dtype=np.int64)
        self._next = np.zeros(cap, dtype=np.int64)

    def __len__(self) -> int:
        """Samples held, all cells together."""
        return int(self._count[list(self._rows.values())].sum()) if self._rows else 0

    def cells(self) -> list[Cell]:
        return list(self._rows)

    def append(self, cell: Cell, t: TransferTimes, offsets: Mapping[Ident, float] | None = None) -> None:
        """One transfer of ``cell``; the cell's oldest goes once it holds ``window``. ``offsets``:
        the ranks' clock offsets known now, for the reading stalls are counted on."""
        row = self._rows.get(cell)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else len(self._rows)
            if row >= len(self._count):
                self._grow()
            self._rows[cell] = row
            self._count[row] = self._next[row] = 0
            self._as_read[row] = np.nan  # a reused row's old readings are not this cell's
        i = int(self._next[row])
        for name in _FIELDS:
            self._f[name][row, i] = getattr(t, name)
        self._sender[row, i] = self._ident(t.sender)
        self._receiver[row, i] = self._ident(t.receiver)
        read = None
        if offsets is not None and t.sender in offsets and t.receiver in offsets:
            read = transfer_time(t, offsets[t.sender], offsets[t.receiver], 0.0)
        self._as_read[row, i] = np.nan if read is None else read
        self._next[row] = (i + 1) % self.window
        self._count[row] = min(int(self._count[row]) + 1, self.window)

    def forget(self, replica: int) -> None:
        """Every cell with ``replica`` at either end, and its ranks' indices."""
        for cell in [c for c in self._rows if replica in c]:
            self._free_rows.append(self._rows.pop(cell))
        for ident in [i for i in self._idents if i[0] == replica]:
            self._free_idents.append(self._idents.pop(ident))

    def times(self, offsets: Mapping[Ident, float]) -> CellTimes:
        """Each cell's newest ``recent`` transfer times in seconds per MB, read with ``offsets``
        (each rank's clock to the coordinator's) and the pairs' corrections from those
        transfers; a transfer with an end of unknown offset, or awaited by a pair not
        reconciled, is left out. With a longer ``window``, the stall counts read all of it."""
        if not self._rows:
            return CellTimes([], np.zeros((0, self.recent)))
        cells = list(self._rows)
        rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(cells))
        count = self._count[rows][:, None]
        ages = np.arange(self.recent)[None, :]
        slots = rows[:, None] * self.window + (self._next[rows][:, None] - 1 - ages) % self.window  # newest first
        valid = ages < count
        off = np.full(len(self._idents) + len(self._free_idents), np.nan)
        for ident, i in self._idents.items():
            if ident in offsets:
                off[i] = offsets[ident]
        s, r = self._sender.reshape(-1)[slots], self._receiver.reshape(-1)[slots]
        field = {name: a.reshape(-1)[slots] for name, a in self._f.items()}
        send_post = field["send_post"] + off[s]
        recv_post = field["recv_post"] + off[r]
        recv_done = field["recv_done"] + off[r]
        known = valid & ~np.isnan(send_post) & ~np.isnan(recv_post)
        awaited = known & (recv_post <= send_post)
        fix = _corrections(s, r, recv_done - send_post, awaited, len(off))
        start = np.where(recv_post > send_post, recv_post, send_post + fix)
        queued_after = np.maximum(0.0, field["recv_queued"] - np.maximum(0.0, start - recv_post))
        x = (recv_done - start - queued_after) / field["mb"]
        x[~known] = np.nan
        if self.recent == self.window:
            return CellTimes(cells, x)
        return CellTimes(cells, x, stall_values=self._as_read[rows])

    def _ident(self, ident: Ident) -> int:
        i = self._idents.get(ident)
        if i is None:
            i = self._free_idents.pop() if self._free_idents else len(self._idents)
            self._idents[ident] = i
        return i

    def _grow(self) -> None:
        cap = 2 * len(self._count)
        for name, a in self._f.items():
            self._f[name] = np.concatenate([a, np.zeros_like(a)])
        self._as_read = np.concatenate([self._as_read, np.full_like(self._as_read, np.nan)])
        self._sender = np.concatenate([self._sender, np.zeros_like(self._sender)])
        self._receiver = np.concatenate([self._receiver, np.zeros_like(self._receiver)])
        self._count = np.concatenate([self._count, np.zeros(cap // 2, dtype=np.int64)])
        self._next = np.concatenate([self._next, np.zeros(cap // 2, dtype=np.int64)])


def _corrections(s: np.ndarray, r: np.ndarray, x: np.ndarray, awaited: np.ndarray, n: int) -> np.ndarray:
    """Per sample, its pair's clock correction (:func:`links.clock_corrections`), NaN where the
    pair has no awaited transfers both ways."""
    out = np.full(s.shape, np.nan)
    if not awaited.any():
        return out
    pair = s * n + r
    codes, inverse = np.unique(pair[awaited], return_inverse=True)
    fastest = np.full(len(codes), np.inf)
    np.minimum.at(fastest, inverse, x[awaited])
    back = (codes % n) * n + codes // n
    at = np.clip(np.searchsorted(codes, back), 0, len(codes) - 1)
    has_back = codes[at] == back
    fix_of_code = np.where(has_back, (fastest - fastest[at]) / 2, np.nan)
    at_all = np.clip(np.searchsorted(codes, pair), 0, len(codes) - 1)
    return np.where(codes[at_all] == pair, fix_of_code[at_all], np.nan)
