"""Wrappers that put the step protocol into an ordinary training loop.

``zero_grad()`` starts the step (the quorum request overlaps the forward pass) and ``step()``
ends the gradient exchange (:meth:`~unbroken.train.manager.Manager.sync_gradients`), then
applies the wrapped optimizer only if every rank of this replica group exchanged successfully,
with the learning rate scaled while replicas are missing. The loop keeps its usual shape::

    optimizer = unbroken.Optimizer(torch.optim.AdamW(model.parameters()), manager)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    optimizer.zero_grad(); loss.backward(); optimizer.step(); scheduler.step()
    if manager.last_step_committed: ...
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from unbroken.train.interface import StepDriver


def trainable_parameters(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]


def gradient_numel(params: Iterable[torch.nn.Parameter]) -> int:
    """Elements :func:`average_gradients` exchanges for ``params`` (local shards of DTensors)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainable_parameters(params))


def gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params``; one without a gradient gets zeros, so that every replica
    exchanges the same layout (a parameter unused on one replica is used on another)."""
    grads = []
    for p in trainable_parameters(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def average_gradients(manager: StepDriver, params: Iterable[torch.nn.Parameter]) -> bool:
    """Averages the gradients of ``params`` across replicas; True when the step may commit.

    Works for plain tensors and for FSDP2's sharded (DTensor) gradients, whose local shards
    are exchanged with the same shard of the other replicas: the hook for HSDP-style training.
    """
    return manager.sync_gradients(gradients(params))


class Optimizer(torch.optim.Optimizer):
    """A fault-tolerant ``torch.optim.Optimizer``: the wrapped one, stepped only when the step
    commits.

    It shares the wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` (the same
    objects), so learning-rate schedulers, ``add_param_group`` (the new parameters join the
    exchange) and ``state_dict()``/``load_state_dict()`` act on the wrapped optimizer; step
    hooks registered here run around this ``step()``. ``step(closure)`` returns the closure's
    loss, or None, as torch's do; whether the step was applied is
    :attr:`Manager.last_step_committed <unbroken.train.manager.Manager>`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, manager: StepDriver) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"unbroken.Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        # Not super().__init__(): it would build param groups of its own instead of sharing them.
        self.optimizer = optimizer
        self.manager = manager
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()  # step hooks, as torch's own optimizers get them
        self._expect_gradients()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "manager": self.manager}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizer"], state["manager"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"unbroken.Optimizer({self.optimizer!r})"

    def _expect_gradients(self) -> None:
        numel = gradient_numel(p for g in self.optimizer.param_groups for p in g["params"])
        if numel:
            self.manager.expect_gradients(numel)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds the group to the wrapped optimizer; its parameters join the gradient exchange."""
        self.optimizer.add_param_group(param_group)
        self._expect_gradients()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    # The state-dict hooks belong where the state dict is made: the wrapped optimizer.
    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step (its quorum request travels while the forward pass runs)."""
        self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Ends the gradient exchange and, if it succeeded, steps the wrapped optimizer.

        Returns what the wrapped optimizer's step returns (the closure's loss, or None); None
        when the step was not applied (see :attr:`Manager.last_step_committed`). The gradients
        are averaged before the closure runs, so a closure must not compute them again (as
        LBFGS's does): those would be this replica's alone. Step hooks registered here run
        whether or not the step is applied; those of the wrapped optimizer only when it is.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not self.manager.sync_gradients(gradients(params)):
            return None
        self.manager.request_next_quorum()  # its answer travels while the wrapped optimizer steps
        scale = self.manager.lr_scale
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * scale
        try:
            loss = self.optimizer.step(closure)
        finally:
            for g, lr in zip(self.optimizer.param_groups, saved, strict=False):
                g["lr"] = lr
        self.manager.commit()
        return loss
