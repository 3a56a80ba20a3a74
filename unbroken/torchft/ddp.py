"""torchft's ``DistributedDataParallel(manager, module)``: unbroken's bucketed DDP.

The gradients are averaged across replicas bucket by bucket during the backward pass
(:class:`unbroken.train.ddp.DistributedDataParallel`); torchft's wrapper does the same through
a communication hook on torch's DDP. ``torchft.Optimizer`` then commits the step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from unbroken.torchft.manager import Manager
from unbroken.train.ddp import DistributedDataParallel as _UnbrokenDDP


class DistributedDataParallel(_UnbrokenDDP):
    """``torchft.DistributedDataParallel(manager, module, **kwargs)``: ``bucket_cap_mb`` is
    honoured; torch DDP's other options (``find_unused_parameters``, ``broadcast_buffers``...)
    are accepted and ignored: every parameter is exchanged, and buffers are not synchronised."""

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, manager._manager, bucket_cap_mb=float(kwargs.get("bucket_cap_mb") or 25.0))


class PureDistributedDataParallel(nn.Module):
    """torchft's per-parameter variant: one :meth:`Manager.allreduce` per gradient."""

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def post_grad_hook(p: Any) -> None:
            if p.grad is not None:
                manager.allreduce(p.grad)

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(post_grad_hook)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)
