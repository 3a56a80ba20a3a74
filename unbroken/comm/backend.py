"""Which backend carries an epoch's cross-replica exchange: NCCL or Gloo.

NCCL is what makes the exchange fast on GPUs, but it refuses two ranks of one communicator on
one GPU (``invalid usage``), which is common on a test box, or with a spare packed onto a
busy GPU. Gloo carries CUDA tensors too (through host memory), slower but anywhere. With
``auto``, the members of each epoch's group tell each other which GPU they hold (host and the
GPU's UUID, through the epoch's rendezvous store) and every member applies
:func:`choose_backend` to the same list, so they agree without another message: NCCL when every
member holds a distinct GPU, Gloo otherwise. Deciding per epoch keeps one shared GPU (a spare
that joins) from breaking the epochs it is not part of.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from unbroken.config import CrossReplicaBackend


def check_backend(setting: str, device: torch.device) -> None:
    """Raises ValueError for a setting that can never work on ``device``, before any epoch."""
    CrossReplicaBackend.parse(setting, "the cross-replica backend")
    if setting == "nccl" and device.type != "cuda":
        raise ValueError(
            f"--cross-replica-backend nccl needs CUDA tensors, but the exchange's device is {device}: "
            "pass device=torch.device('cuda') to unbroken.init(), or use gloo"
        )


def choose_backend(setting: str, device_type: str, identities: Sequence[str] = ()) -> str:
    """The backend of one epoch's group: ``nccl`` or ``gloo``.

    Args:
        setting: ``auto``, ``nccl`` or ``gloo``.
        device_type: where the tensors live (``cuda`` or ``cpu``).
        identities: with ``auto`` on CUDA, each member's GPU (:func:`gpu_identity`), in rank order.
    """
    CrossReplicaBackend.parse(setting, "the cross-replica backend")
    if device_type != "cuda" or setting == "gloo":
        return "gloo"
    if setting == "nccl":
        return "nccl"
    return "nccl" if len(set(identities)) == len(identities) else "gloo"


def gpu_identity(device: torch.device) -> str:
    """``HOST/UUID`` of the GPU behind ``device``: two ranks with the same one share a GPU."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None) or getattr(props, "pci_bus_id", None) or index
    return f"{os.uname().nodename}/{uuid}"
