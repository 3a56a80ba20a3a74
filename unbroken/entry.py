"""The worker entry point: ``unbroken.init()`` joins the job with what the launcher asked for.

Above ``train`` and ``faults``: it builds the :class:`~unbroken.train.manager.Manager` (with
:func:`~unbroken.train.factory.build_manager`) and installs the fault hooks the launcher planned
for this rank (the worker-side faults of the schedule and a link fault, both read from the
environment through :mod:`unbroken.config`), so that ``train`` never imports fault injection.
"""

from __future__ import annotations

import torch

from unbroken.comm.deadline import LearnedDeadline
from unbroken.config import ReplicaConfig
from unbroken.faults.link import LinkFault
from unbroken.faults.worker_chaos import WorkerChaos
from unbroken.train.factory import build_manager
from unbroken.train.manager import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUORUM_TIMEOUT_S,
    Manager,
)
from unbroken.train.state import LoadStateDictFn, StateDictFn


def init(
    state_dict: StateDictFn | None = None,
    load_state_dict: LoadStateDictFn | None = None,
    *,
    config: ReplicaConfig | None = None,
    device: torch.device | None = None,
    deadline: LearnedDeadline | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    quorum_timeout_s: float = DEFAULT_QUORUM_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    cross_replica_backend: str | None = None,
) -> Manager:
    """Joins the fault-tolerant job this process was launched into (see ``unbroken run``).

    Register what a recovering peer needs with :meth:`Manager.register_state_dict_fn`
    (``state_dict``/``load_state_dict`` here register one state under ``"state"``). The
    default process group of the replica's own ranks is created only if the script has not
    created it. Use as ``with unbroken.init() as manager:`` to leave the job cleanly.

    ``cross_replica_backend``: ``auto`` (NCCL when every member of an epoch holds a distinct
    GPU, else Gloo carrying the CUDA tensors), ``nccl`` or ``gloo``; None takes
    ``unbroken run --cross-replica-backend`` (``UNBROKEN_CROSS_REPLICA_BACKEND``), else ``auto``.
    """
    config = config or ReplicaConfig.from_env()
    return build_manager(
        state_dict,
        load_state_dict,
        config=config,
        device=device,
        deadline=deadline,
        max_attempts=max_attempts,
        quorum_timeout_s=quorum_timeout_s,
        connect_timeout_s=connect_timeout_s,
        fault_hook=WorkerChaos.from_env(config.replica_id),
        link_fault=LinkFault.from_env(),
        cross_replica_backend=cross_replica_backend,
    )
