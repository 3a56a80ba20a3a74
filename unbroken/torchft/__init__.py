"""torchft's public API over unbroken: torchft and torchtitan scripts run unchanged.

``unbroken run --torchft-compat`` puts a ``torchft`` package on the workers' path that is this
one (``import torchft``, ``from torchft.local_sgd import DiLoCo``, ...), so a loop written for
``torchft.Manager`` trains on unbroken's coordinator, fault-tolerant exchange and catch-up.
What maps onto what, and what differs, is in docs/torchtitan.md and
:mod:`unbroken.torchft.manager`.
"""

from __future__ import annotations

from unbroken.torchft import checkpointing, data, ddp, lighthouse, local_sgd, manager, optim, process_group
from unbroken.torchft.data import DistributedSampler
from unbroken.torchft.ddp import DistributedDataParallel
from unbroken.torchft.manager import Manager, WorldSizeMode
from unbroken.torchft.optim import OptimizerWrapper
from unbroken.torchft.optim import OptimizerWrapper as Optimizer
from unbroken.torchft.process_group import (
    ManagedProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "ManagedProcessGroup",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "WorldSizeMode",
    "checkpointing",
    "data",
    "ddp",
    "lighthouse",
    "local_sgd",
    "manager",
    "optim",
    "process_group",
]
