"""torchft's ``OptimizerWrapper`` (``torchft.Optimizer``): the quorum at ``zero_grad``, the
commit at ``step``.

As torchft's: ``zero_grad()`` starts the step (:meth:`Manager.start_quorum`), ``step()`` steps
the wrapped optimizer only when :meth:`Manager.should_commit` says so. Unlike torchft's, the
wrapper hands the parameters' gradients to the commit, so that in a step in which a replica
catches up (unbroken then exchanges the whole step at its end) the average lands in ``.grad``
before the optimizer steps, and it announces their size, so that a catching-up replica starts
its zero exchange as soon as its quorum answers. The learning rate is not scaled while replicas
are missing (torchft does not; ``unbroken.Optimizer`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unbroken.torchft.manager import Manager
from unbroken.train.optimizer import gradient_numel, gradients


class OptimizerWrapper(torch.optim.Optimizer):
    """Steps ``optim`` only in steps that commit (``torchft.Optimizer``)."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        # Not super().__init__(), as torchft's: the wrapped optimizer owns the param groups.
        self.optim = optim
        self.manager = manager
        numel = gradient_numel(self._params())
        if numel:
            manager._manager.expect_gradients(numel)

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
            self.optim.step()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property  # type: ignore[override]
    def state(self) -> Mapping[torch.Tensor, Any]:
        return self.optim.state


Optimizer = OptimizerWrapper
