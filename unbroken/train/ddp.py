"""``DistributedDataParallel`` over the replicas: gradients averaged during the backward pass.

Like ``torch.nn.parallel.DistributedDataParallel``, parameters are grouped into buckets of about
``bucket_cap_mb`` in reverse registration order (roughly the order in which the backward pass
produces their gradients), and a bucket's exchange starts the moment its last gradient is
accumulated, while the backward pass computes the rest. An end-of-backward callback waits for
every bucket, so when ``loss.backward()`` returns ``.grad`` holds the cross-replica average and
``clip_grad_norm_`` sees the norm of the average.

Fault semantics are those of :meth:`Manager.allreduce`: each bucket carries the step's metadata
(contributing, step, skipped) and is checked; waits are bounded by the learned deadline and the
coordinator's abort. Buckets are exchanged in copies, and the averages are written into ``.grad``
only once every bucket succeeded and every rank of this replica agreed; after a failure the
gradients still hold this replica's own values and the step is redone, in the same call, in a new
epoch on the synchronous path. A step in which a replica catches up is exchanged on that path too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from unbroken.train.interface import BucketExchange
from unbroken.train.step.overlap import METADATA

FIRST_BUCKET_MB = 1.0  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES is 1 MiB


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``params`` per bucket, last parameter first (the order backward reaches them).

    The first bucket is capped at ``first_cap_bytes`` (default ``cap_bytes``): small, as torch's
    DDP makes it (1 MiB), so that the exchange starts early in the backward pass instead of
    after a whole 25 MB of gradients, which for a small model is all of them.
    """
    buckets: list[list[int]] = []
    cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    size = cap  # forces a new bucket on the first parameter
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * 4  # exchanged in float32
        if size + nbytes > cap and (not buckets or buckets[-1]):
            if buckets:
                cap = cap_bytes
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


class DistributedDataParallel(torch.nn.Module):
    """Averages gradients across replicas during the backward pass, bucket by bucket.

    The forward pass starts the step (its quorum request travels while it runs). After
    ``loss.backward()``, ``.grad`` holds the average; ``unbroken.Optimizer.step`` then applies
    the step without exchanging again (it asks ``manager.sync_gradients``)::

        model = unbroken.DistributedDataParallel(net, manager)
        optimizer = unbroken.Optimizer(torch.optim.AdamW(net.parameters()), manager)
        loss = model(x).sum(); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    Args:
        module: the model; every replica holds the same parameters in the same order.
        manager: this rank's :class:`Manager`.
        bucket_cap_mb: the size of a bucket (float32 bytes), as in torch's DDP.
        first_bucket_cap_mb: the size of the first bucket (the last layers' gradients), small
            so that exchanging starts early; default ``min(1 MiB, bucket_cap_mb)`` like torch's
            DDP.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        manager: BucketExchange,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = min(FIRST_BUCKET_MB, bucket_cap_mb)
        if first_bucket_cap_mb <= 0:
            raise ValueError(f"first_bucket_cap_mb must be > 0, got {first_bucket_cap_mb}")
        self.module = module
        self.manager = manager
        seen: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:  # a shared parameter is exchanged once
                seen.add(id(p))
                self._params.append(p)
        self._buckets = _buckets(
            self._params, max(1, int(bucket_cap_mb * 2**20)), max(1, int(first_bucket_cap_mb * 2**20))
        )
        self._bucket_of = {i: b for b, idx in enumerate(self._buckets) for i in idx}
        self._numel = [sum(self._params[i].numel() for i in idx) for idx in self._buckets]
        self._bucket_buffers: list[torch.Tensor | None] = [None] * len(self._buckets)
        self._sync = True
        self._wrote = False
        self._reset()
        if self._params:
            manager.expect_gradients(sum(self._numel))
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.manager.start_step()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients; the next one outside averages them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    @property
    def buckets_started(self) -> int:
        """Buckets whose exchange the current backward pass has started."""
        return self._next

    # -- during backward -----------------------------------------------------------------

    def _reset(self) -> None:
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self._queued = False

    def _grad_ready(self, i: int) -> None:
        if not self._sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        b = self._bucket_of[i]
        self._ready[b] += 1
        while self._next < len(self._buckets) and self._ready[self._next] >= len(self._buckets[self._next]):
            self._start(self._next)
            self._next += 1

    def _start(self, b: int) -> None:
        o = self.manager.begin_overlap()
        if o.decision is None or o.failed:
            return  # exchanged after backward (a replica catches up), or redone after a failure
        n = self._numel[b]
        buf = self._bucket_buffers[b]
        if buf is None:
            buf = torch.empty(n + METADATA, dtype=torch.float32, device=self._params[self._buckets[b][0]].device)
        offset = 0
        for i in self._buckets[b]:
            p = self._params[i]
            k = p.numel()
            if p.grad is None:
                buf[offset : offset + k].zero_()
            else:
                buf[offset : offset + k].copy_(p.grad.reshape(-1))
            offset += k
        self._bucket_buffers[b] = buf
        self.manager.start_bucket(buf)

    def _end_backward(self) -> None:
        """The end of the backward pass: starts the buckets of unused parameters, then waits."""
        try:
            while self._next < len(self._buckets):
                self._start(self._next)
                self._next += 1
            grads: list[torch.Tensor] = []
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            self._wrote = False
            self.manager.end_overlap(grads, self._write_back)
            if not self._wrote:
                self._bucket_buffers = [None] * len(self._buckets)  # the backend may still write into them
        finally:
            self._reset()

    def _write_back(self, scale: float) -> None:
        self._wrote = True
        for b, idx in enumerate(self._buckets):
            buf = self._bucket_buffers[b]
            assert buf is not None
            offset = 0
            for i in idx:
                g = self._params[i].grad
                assert g is not None
                torch.mul(buf[offset : offset + g.numel()].view_as(g), scale, out=g)
                offset += g.numel()
