"""Wrappers that put the step protocol into an ordinary training loop.

``zero_grad()`` starts the step (the quorum request overlaps the forward pass) and ``step()``
averages gradients across replicas, then applies the wrapped optimizer only if every rank of
this replica group exchanged successfully, with the learning rate scaled while replicas are
missing. The loop keeps its usual shape::

    optimizer = unbroken.Optimizer(torch.optim.AdamW(model.parameters()), manager)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from unbroken.train.manager import Manager


def trainable_parameters(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]


def gradient_numel(params: Iterable[torch.nn.Parameter]) -> int:
    """Elements :func:`average_gradients` exchanges for ``params`` (local shards of DTensors)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainable_parameters(params))


def average_gradients(manager: Manager, params: Iterable[torch.nn.Parameter]) -> bool:
    """Averages the gradients of ``params`` across replicas; True when the step may commit.

    Works for plain tensors and for FSDP2's sharded (DTensor) gradients, whose local shards
    are exchanged with the same shard of the other replicas: the hook for HSDP-style training.
    A parameter without a gradient contributes zeros, so every replica's layout matches.
    """
    grads = []
    for p in trainable_parameters(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return manager.allreduce(grads)


class Optimizer:
    """A fault-tolerant view of a ``torch.optim.Optimizer`` (same ``param_groups`` and state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, manager: Manager) -> None:
        self.optimizer = optimizer
        self.manager = manager
        numel = gradient_numel(p for g in optimizer.param_groups for p in g["params"])
        if numel:
            manager.expect_gradients(numel)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> bool:
        """Exchanges gradients and applies the step; returns whether it was committed."""
        grads = []
        for p in trainable_parameters(p for g in self.optimizer.param_groups for p in g["params"]):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not self.manager.sync_gradients(grads):
            return False
        scale = self.manager.lr_scale
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * scale
        try:
            self.optimizer.step(closure)
        finally:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr
        self.manager.commit()
        return True


class DataParallel(torch.nn.Module):
    """DDP-style wrapper: the forward pass starts the step; ``average_gradients()`` ends it.

    For loops that call the optimizer themselves::

        model = unbroken.DataParallel(net, manager)
        loss = model(x).sum(); loss.backward()
        if model.average_gradients():
            opt.step(); manager.commit()
    """

    def __init__(self, module: torch.nn.Module, manager: Manager) -> None:
        super().__init__()
        self.module = module
        self.manager = manager
        numel = gradient_numel(module.parameters())
        if numel:
            manager.expect_gradients(numel)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.manager.start_step()
        return self.module(*args, **kwargs)

    def average_gradients(self) -> bool:
        return average_gradients(self.manager, self.module.parameters())
