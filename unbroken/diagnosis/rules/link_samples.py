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

from unbroken.diagnosis.rules.links import Cell, CellTimes, TransferTimes

Ident = tuple[int, int]  # (replica, rank)
_FIELDS = ("send_post", "recv_post", "recv_done", "recv_queued", "mb")


class LinkSamples:
    """The last ``window`` transfers of each (sender, receiver) replica cell, as arrays.

    Each cell owns a row of ``window`` slots, filled as a ring; rows and rank indices of a
    forgotten replica are reused, so the store holds at most one row per live cell.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 transfer, got {window}")
        self.window = window
        self._rows: dict[Cell, int] = {}
        self._free_rows: list[int] = []
        self._idents: dict[Ident, int] = {}
        self._free_idents: list[int] = []
        cap = 8
        self._f = {name: np.zeros((cap, window)) for name in _FIELDS}
        self._sender = np.zeros((cap, window), dtype=np.int64)
        self._receiver = np.zeros((cap, window), dtype=np.int64)
        self._count = np.zeros(cap, dtype=np.int64)
        self._next = np.zeros(cap, dtype=np.int64)

    def __len__(self) -> int:
        """Samples held, all cells together."""
        return int(self._count[list(self._rows.values())].sum()) if self._rows else 0

    def cells(self) -> list[Cell]:
        return list(self._rows)

    def append(self, cell: Cell, t: TransferTimes) -> None:
        """One transfer of ``cell``; the cell's oldest goes once it holds ``window``."""
        row = self._rows.get(cell)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else len(self._rows)
            if row >= len(self._count):
                self._grow()
            self._rows[cell] = row
            self._count[row] = self._next[row] = 0
        i = int(self._next[row])
        for name in _FIELDS:
            self._f[name][row, i] = getattr(t, name)
        self._sender[row, i] = self._ident(t.sender)
        self._receiver[row, i] = self._ident(t.receiver)
        self._next[row] = (i + 1) % self.window
        self._count[row] = min(int(self._count[row]) + 1, self.window)

    def forget(self, replica: int) -> None:
        """Every cell with ``replica`` at either end, and its ranks' indices."""
        for cell in [c for c in self._rows if replica in c]:
            self._free_rows.append(self._rows.pop(cell))
        for ident in [i for i in self._idents if i[0] == replica]:
            self._free_idents.append(self._idents.pop(ident))

    def times(self, offsets: Mapping[Ident, float]) -> CellTimes:
        """Each cell's transfer times in seconds per MB, read with ``offsets`` (each rank's clock
        to the coordinator's) and the pairs' corrections from their own transfers; a transfer
        with an end of unknown offset, or awaited by a pair not reconciled, is left out."""
        if not self._rows:
            return CellTimes([], np.zeros((0, self.window)))
        cells = list(self._rows)
        rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(cells))
        valid = np.arange(self.window)[None, :] < self._count[rows][:, None]
        off = np.full(len(self._idents) + len(self._free_idents), np.nan)
        for ident, i in self._idents.items():
            if ident in offsets:
                off[i] = offsets[ident]
        s, r = self._sender[rows], self._receiver[rows]
        send_post = self._f["send_post"][rows] + off[s]
        recv_post = self._f["recv_post"][rows] + off[r]
        recv_done = self._f["recv_done"][rows] + off[r]
        known = valid & ~np.isnan(send_post) & ~np.isnan(recv_post)
        awaited = known & (recv_post <= send_post)
        fix = _corrections(s, r, recv_done - send_post, awaited, len(off))
        start = np.where(recv_post > send_post, recv_post, send_post + fix)
        queued_after = np.maximum(0.0, self._f["recv_queued"][rows] - np.maximum(0.0, start - recv_post))
        x = (recv_done - start - queued_after) / self._f["mb"][rows]
        x[~known] = np.nan
        return CellTimes(cells, x)

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
