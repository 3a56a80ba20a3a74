"""The connection matrix of the ring exchange: transfer halves paired into samples, judged.

Each rank reports its side of every ring transfer (post and completion on its own clock); two
sides make one sample of the (sender, receiver) cell (:class:`~unbroken.diagnosis.rules.links.TransferTimes`),
kept in :class:`~unbroken.diagnosis.rules.link_samples.LinkSamples`. At each new collective
:meth:`ConnectionMatrix.judge` reads them with the clock offsets known then and applies the link
rules (:mod:`unbroken.diagnosis.rules.links`): a slow or stalling node or link, once its finding
held ``link_confirm`` collectives. Pure; the master (:mod:`unbroken.diagnosis.master.master`)
owns the ranks and their offsets and passes them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unbroken.diagnosis.master.master_state import Ident, MasterSettings
from unbroken.diagnosis.rules import links
from unbroken.diagnosis.rules.link_samples import LinkSamples

MAX_HALVES = 512  # transfer sides waiting for their other side (older ones are dropped)


class ConnectionMatrix:
    """The samples of every replica-to-replica connection, and the slow-link finding's streak."""

    def __init__(self, settings: MasterSettings) -> None:
        self.s = settings
        self.cells = LinkSamples(max(settings.link_stall_window, settings.link_window), recent=settings.link_window)
        self._halves: dict[tuple[Any, ...], tuple[Ident, float, float, int, float]] = {}
        self._streak: tuple[Any, int, int] = (None, 0, -1)

    def __len__(self) -> int:
        """Entries held: samples and unpaired halves."""
        return len(self.cells) + len(self._halves)

    def half(
        self,
        group: str,
        seq: int,
        step: int,
        direction: str,
        ident: Ident,
        peer: int,
        post: float,
        done: float,
        nbytes: int,
        queued_s: float,
        offsets: Mapping[Ident, float],
    ) -> None:
        """One side of a transfer (times on ``ident``'s own clock); with the other side, one
        sample for its link's cell. ``offsets``: the ranks' clock offsets known now.

        ``queued_s``: how long this side's thread waited for a CPU during the transfer. The
        receiver's is subtracted: data that arrived while its thread waited for a CPU held by
        other processes waited on the machine, not on the wire.
        """
        if seq < self.s.link_warmup:
            return
        me = ident[0]
        src, dst = (me, peer) if direction == "send" else (peer, me)
        key = (group, seq, step, src, dst)
        other = self._halves.pop(key, None)
        if other is None:
            self._halves[key] = (ident, post, done, nbytes, queued_s)
            if len(self._halves) > MAX_HALVES:
                self._halves.pop(next(iter(self._halves)))
            return
        if direction == "recv":
            sender, send_post = other[0], other[1]
            receiver, recv_post, recv_done, recv_queued = ident, post, done, queued_s
        else:
            sender, send_post = ident, post
            receiver, recv_post, recv_done, recv_queued = other[0], other[1], other[2], other[4]
        sample = links.TransferTimes(
            sender, receiver, send_post, recv_post, recv_done, recv_queued, max(nbytes, 1) / 1e6
        )
        self.cells.append((src, dst), sample, offsets=offsets)

    def forget(self, replica: int) -> None:
        self.cells.forget(replica)

    def judge(
        self, offsets: Mapping[Ident, float], arrived: int, scores: dict[str, dict[str, float]]
    ) -> links.LinkFinding | None:
        """The slow or stalling node or link, once its finding held ``link_confirm`` new
        collectives (``arrived`` counts them); the rules' scores go into ``scores``.

        Each cell is read with the ``offsets`` known now, which improve as the job runs (a
        sample mapped when it came kept the error of its day: healthy links read -40 ms/MB in
        the box), and each pair's correction from its own transfers."""
        cells = self.cells.times(offsets)
        got = links.link_scores(cells, self.s.link_min_samples, self.s.link_quantile)
        scores["link"] = {f"{a}-{b}": round(x, 4) for (a, b), x in got.items()}
        lone = links.one_way_scores(cells, self.s.link_min_samples, self.s.link_quantile)
        scores["link_one_way"] = {f"{a}-{b}": round(x, 4) for (a, b), x in lone.items()}
        f = links.classify_slow(cells, self.s.link_ratio, self.s.link_min_samples, self.s.link_quantile)
        if f is None:
            f = links.classify_stalling(cells, self.s.link_min_samples, self.s.link_quantile)
        # Which direction of a slow link is the slower may flip between collectives; the link does not.
        sig = (f.pattern, frozenset(f.link) if f.link else f.replica, f.cause) if f else None
        prev, n, at = self._streak
        # Counted in new collectives, not evaluations: one slow burst re-read at every tick
        # of the coordinator is still one burst. A node and one of its own links are the same
        # evidence seen more or less whole (a lossy host's second link shows its stalls a few
        # collectives after the first): the streak goes on.
        n = 1 if not links.same_evidence(sig, prev) else n + (at != arrived)
        self._streak = (sig, n, arrived)
        return f if f is not None and n >= self.s.link_confirm else None
