"""A CPU-driven ring all-reduce from point-to-point sends and receives.

The backend's all-reduce hides its connections: when it stalls, nobody can say which link.
FT-HSDP's FTAR and ICCL drive the ring from the CPU instead; every chunk then has a sender, a
receiver, a post time and a completion time, which is exactly the per-connection evidence the
diagnosis needs, and a place where a fault on one link can be injected for real.

Reduce-scatter then all-gather over ``2 * (n - 1)`` steps. In each step a rank posts the receive
from its predecessor, then the send to its successor, and waits for both; the reduction is an
in-place add. The ring alternates direction with the sequence number so that, over two
collectives, every ordered pair of members carries traffic: the connection matrix is full and
a slow row (sender), column (receiver) and cell (link) can be told apart.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

# (work) -> None; raises when the deadline passed or the epoch was aborted.
WaitFn = Callable[[Any], None]


class LinkHook(Protocol):
    """Observes (and, for fault injection, delays) the transfers of one collective."""

    def posted(self, direction: str, peer: int, step: int, nbytes: int) -> int: ...

    def done(self, direction: str, peer: int, step: int, token: int) -> None: ...

    def send_delay_s(self, peer: int, step: int, nbytes: int) -> float:
        """Seconds the wire to ``peer`` holds this send (0: none; inf: it never arrives)."""
        ...


def ring_order(size: int, seq: int) -> list[int]:
    """Member order of the ring for collective ``seq``: forward on even, reversed on odd."""
    order = list(range(size))
    return order if seq % 2 == 0 else order[::-1]


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """``size`` contiguous, nearly equal slices of ``numel`` elements."""
    base, extra = divmod(numel, size)
    bounds, start = [], 0
    for i in range(size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_allreduce_sum(
    pg: Any,
    tensor: torch.Tensor,
    rank: int,
    size: int,
    seq: int,
    wait: WaitFn,
    hook: LinkHook | None = None,
    pieces: int = 4,
) -> None:
    """Sums the flat ``tensor`` in place over the ``size`` members of ``pg``.

    Args:
        pg: a ``torch.distributed`` process group object (``send``/``recv`` with tags).
        seq: this collective's sequence number in the group: picks the ring direction and
            keeps tags of different collectives apart.
        wait: bounds every wait (deadline, abort).
        hook: recorder of per-connection timings; may delay a send to emulate a bad link.
    """
    order = ring_order(size, seq)
    pos = order.index(rank)
    succ, pred = order[(pos + 1) % size], order[(pos - 1) % size]
    bounds = chunk_bounds(tensor.numel(), size)
    largest = max(e - s for s, e in bounds)
    scratch = torch.empty(largest, dtype=tensor.dtype, device=tensor.device)
    tag_base = (seq % 1024) * 2 * size
    steps = 2 * (size - 1)
    for step in range(steps):
        reduce = step < size - 1
        k = step if reduce else step - (size - 1)
        send_idx = (pos - k + (0 if reduce else 1)) % size
        recv_idx = (pos - k - 1 + (0 if reduce else 1)) % size
        s0, s1 = bounds[send_idx]
        r0, r1 = bounds[recv_idx]
        dest = scratch[: r1 - r0] if reduce else tensor[r0:r1]
        tag = tag_base + step
        # Pieces let the add of one piece overlap the transfer of the next.
        rparts = [(a + r0, b + r0) for a, b in chunk_bounds(r1 - r0, pieces)]
        sparts = [(a + s0, b + s0) for a, b in chunk_bounds(s1 - s0, pieces)]
        rbytes, sbytes = (r1 - r0) * tensor.element_size(), (s1 - s0) * tensor.element_size()
        rtok = hook.posted("recv", pred, step, rbytes) if hook else 0
        rworks = [pg.recv([dest[a - r0 : b - r0]], pred, tag * pieces + i) for i, (a, b) in enumerate(rparts)]
        delay = hook.send_delay_s(succ, step, sbytes) if hook else 0.0
        if delay > 0:
            # An injected slow wire: the data leaves late, but this rank's own receive is not
            # held up by it (on a real link it would not be), so receive first, then send.
            _receive(rparts, rworks, tensor, dest, r0, reduce, wait)
            if hook:
                hook.done("recv", pred, step, rtok)
        stok = hook.posted("send", succ, step, sbytes) if hook else 0
        if delay > 0:
            time.sleep(min(delay, 3600.0))
        sworks = [pg.send([tensor[a:b]], succ, tag * pieces + i) for i, (a, b) in enumerate(sparts)]
        if delay <= 0:
            _receive(rparts, rworks, tensor, dest, r0, reduce, wait)
            if hook:
                hook.done("recv", pred, step, rtok)
        for swork in sworks:
            wait(swork)
        if hook:
            hook.done("send", succ, step, stok)


def _receive(
    rparts: list[tuple[int, int]],
    rworks: list[Any],
    tensor: torch.Tensor,
    dest: torch.Tensor,
    r0: int,
    reduce: bool,
    wait: WaitFn,
) -> None:
    """Waits for each piece of a ring step's receive; reduce steps add it in place."""
    for (a, b), rwork in zip(rparts, rworks, strict=False):
        wait(rwork)
        if reduce:
            tensor[a:b].add_(dest[a - r0 : b - r0])


def plain_wait(timeout_s: float) -> WaitFn:
    """A wait bounded only by a timeout (benchmarks and tests)."""

    def wait(work: Any) -> None:
        work.wait(datetime.timedelta(seconds=timeout_s))

    return wait
