"""torchft's ``OptimizerWrapper`` (``torchft.Optimizer``): the quorum at ``zero_grad``, the
commit at ``step``.

As torchft's: ``zero_grad()`` starts the step (:meth:`Manager.start_quorum`), ``step()`` steps
the wrapped optimizer only when :meth:`Manager.should_commit` says so. Unlike torchft's, the
wrapper hands the parameters' gradients to the commit, so that in a step in which a replica
catches up (unbroken then exchanges the whole step at its end) the average lands in ``.grad``
before the optimizer steps, and it announces their size, so that a catching-up replica starts
its zero exchange as soon as its quorum answers. The learning rate is not scaled while replicas
are missing (torchft does not; ``unbroken.Optimizer`` does).

A replica that catches up also receives its donor's optimizer hyperparameters (the learning
rate of each param group, ...): torchtitan's optimizer state holds only the per-parameter
tensors, and its scheduler's ``load_state_dict`` sets the rate only at its next ``step()``, so
the newcomer's step of the catch-up would use its own, fresh rate and part from the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unbroken.torchft.manager import Manager
from unbroken.train.optimizer import gradient_numel, gradients

HYPERPARAMETERS = "torchft_optimizer_hyperparameters"  # in the state a catching-up replica fetches


class OptimizerWrapper(torch.optim.Optimizer):
    """Steps ``optim`` only in steps that commit (``torchft.Optimizer``)."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        # Not super().__init__(), as torchft's: the wrapped optimizer owns the param groups.
        self.optim = optim
        self.manager = manager
        numel = gradient_numel(self._params())
        if numel:
            manager._manager.expect_gradients(numel)
        # Applied at the step, after every other loader ran: torchtitan's optimizer state also
        # carries param-group values, frozen when it cached its state dict (the first rate).
        self._received: list[list[dict[str, float]]] | None = None
        manager._manager.register_state_dict_fn(HYPERPARAMETERS, self._receive, lambda: hyperparameters(optim))

    def _receive(self, values: list[list[dict[str, float]]]) -> None:
        self._received = values

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
        numel = gradient_numel(self._params())
        if numel:
            self.manager._manager.expect_gradients(numel)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "optimizers that use closures are not supported"
        if self.manager._commit(gradients(self._params())):
            if self._received is not None:  # caught up in this step: the donor's rates
                load_hyperparameters(self.optim, self._received)
                self._received = None
            self.optim.step()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property  # type: ignore[override]
    def state(self) -> Mapping[torch.Tensor, Any]:
        return self.optim.state


Optimizer = OptimizerWrapper


def _optimizers(optim: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose param groups hold the hyperparameters: ``optim``, or those of a
    container (torchtitan's ``OptimizersContainer`` keeps them in ``.optimizers``)."""
    inner = getattr(optim, "optimizers", None)
    if isinstance(inner, list | tuple) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return list(inner)
    return [optim]


def hyperparameters(optim: torch.optim.Optimizer) -> list[list[dict[str, float]]]:
    """Every param group's numeric hyperparameters (``lr``, ``weight_decay``, ...), per optimizer."""
    return [
        [
            {k: float(v) for k, v in g.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            for g in o.param_groups
        ]
        for o in _optimizers(optim)
    ]


def load_hyperparameters(optim: torch.optim.Optimizer, received: list[list[dict[str, float]]]) -> None:
    """Sets what :func:`hyperparameters` read from a donor; a layout that differs is an error."""
    optims = _optimizers(optim)
    if len(received) != len(optims) or any(
        len(r) != len(o.param_groups) for r, o in zip(received, optims, strict=True)
    ):
        raise ValueError("the donor's optimizers have another layout of param groups than this replica's")
    for groups, o in zip(received, optims, strict=True):
        for values, group in zip(groups, o.param_groups, strict=True):
            for k, v in values.items():
                if k in group:
                    group[k] = type(group[k])(v)
