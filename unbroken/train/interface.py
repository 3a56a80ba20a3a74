"""What the wrappers around a :class:`~unbroken.train.manager.Manager` need of it.

:class:`~unbroken.train.optimizer.Optimizer`,
:class:`~unbroken.train.ddp.DistributedDataParallel` and the torch process group of
:mod:`unbroken.train.managed_group` each use a few of the Manager's methods; they are typed with
these protocols rather than the class, so that the process group (which the Manager hands out)
does not import the Manager back, and so that the stand-ins the unit tests drive them with are
checked against the same lists (tests/unit/train/test_fakes_match_manager.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from unbroken.config import ReplicaConfig
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.train.step.overlap import OverlappedExchange


class StepDriver(Protocol):
    """The step protocol as a training loop (or :class:`~unbroken.train.optimizer.Optimizer`) drives it."""

    @property
    def step(self) -> int: ...

    @property
    def last_step_committed(self) -> bool: ...

    @property
    def lr_scale(self) -> float: ...

    def start_step(self) -> None: ...

    def expect_gradients(self, numel: int) -> None: ...

    def sync_gradients(self, grads: list[torch.Tensor]) -> bool: ...

    def request_next_quorum(self) -> None: ...

    def commit(self) -> None: ...


class BucketExchange(Protocol):
    """A step's exchange started bucket by bucket during the backward pass."""

    @property
    def config(self) -> ReplicaConfig: ...

    @property
    def decision(self) -> QuorumDecision | None: ...

    def start_step(self) -> None: ...

    def expect_gradients(self, numel: int) -> None: ...

    def begin_overlap(self) -> OverlappedExchange: ...

    def start_bucket(self, buf: torch.Tensor) -> None: ...

    def wait_buckets(self, last: bool = True) -> bool: ...

    def end_overlap(self, grads: list[torch.Tensor], write_back: Callable[[float], None]) -> bool: ...
