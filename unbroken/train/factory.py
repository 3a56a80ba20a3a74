"""Builds a :class:`~unbroken.train.manager.Manager` and its parts from where this rank sits.

The Manager is given its parts (the coordinator client, the cross-replica group, the catch-up
server, the flight recorder), as torchft's Manager is given its process group and store, so a
test builds one with stand-ins; :func:`build_manager` is what ``unbroken.init()`` calls to build
the real ones, reading the settings of ``unbroken run`` through :mod:`unbroken.config`. It also
sets up what a rank owns beside them: the stack dump on the diagnosis signal, and the default
process group of the replica's own ranks (unless the script created it).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from unbroken.comm.backend import check_backend
from unbroken.comm.catchup import CatchupServer
from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.comm.deadline import LearnedDeadline
from unbroken.comm.recorder import FlightRecorder, LinkDelay
from unbroken.comm.store_client import AuthenticatedStore
from unbroken.comm.transport import make_transport
from unbroken.config import (
    ReplicaConfig,
    anomaly_policy,
    coordinator_host,
    exchange_mode,
    local_address_towards,
    prepare_early,
    recorder_enabled,
    run_dir_given,
    stack_signal,
    verify_exchange,
    weight_check_every,
)
from unbroken.config import connect_timeout_s as connect_timeout_from_env
from unbroken.config import cross_replica_backend as env_cross_replica_backend
from unbroken.control.client import CoordinatorClient
from unbroken.diagnosis.rules.metrics import parse_policy
from unbroken.diagnosis.stack_dump import StackDump, install_stack_dump
from unbroken.diagnosis.stacks import stack_path
from unbroken.train.hooks import FaultHook
from unbroken.train.manager import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUORUM_TIMEOUT_S,
    Manager,
)
from unbroken.train.replica_group import init_replica_group
from unbroken.train.state import LoadStateDictFn, StateDictFn, check_state_pair
from unbroken.train.step.catch_up import DonateHint
from unbroken.train.step.vote import vote_device
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer


@dataclasses.dataclass
class RankResources:
    """What a rank sets up beside the Manager's parts: held for the Manager's life (the stack
    dump's file must stay open for the signal handler), released at its shutdown."""

    stack_dump: StackDump | None = None
    stack_tmp: str | None = None  # a private directory for the stack dump, removed at shutdown
    replica_store: tuple[AuthenticatedStore, StoreServer | None] | None = None

    def close(self) -> None:
        if self.replica_store is not None and self.replica_store[1] is not None:
            self.replica_store[1].close()
        if self.stack_tmp is not None:
            shutil.rmtree(self.stack_tmp, ignore_errors=True)


def build_manager(
    state_dict: StateDictFn | None = None,
    load_state_dict: LoadStateDictFn | None = None,
    *,
    config: ReplicaConfig | None = None,
    device: torch.device | None = None,
    deadline: LearnedDeadline | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    quorum_timeout_s: float = DEFAULT_QUORUM_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    fault_hook: FaultHook | None = None,
    link_fault: LinkDelay | None = None,
    cross_replica_backend: str | None = None,
    secret: JobSecret | None = None,
    stack_dump: bool = True,
) -> Manager:
    """Builds this rank's Manager and connects it to the coordinator (blocks until connected).

    Args:
        config: where this rank sits; read from the environment when omitted.
        device: where gradients live (CPU: the exchange runs on Gloo; CUDA: see
            ``cross_replica_backend``).
        cross_replica_backend: ``auto`` (NCCL when every member of an epoch holds a distinct
            GPU, else Gloo carrying the CUDA tensors), ``nccl`` or ``gloo``; None reads
            ``UNBROKEN_CROSS_REPLICA_BACKEND`` (``unbroken run --cross-replica-backend``).
        connect_timeout_s: how long to wait for the coordinator (the environment's setting wins).
        fault_hook, link_fault: injected faults (``unbroken.init()`` installs them).
        secret: the job's key; None reads the launcher's (``UNBROKEN_SECRET_FILE``). Given by a
            Manager that joins a coordinator of its own process (torchft's lighthouse stand-in).
        stack_dump: install the stack dump on the diagnosis signal; False for a Manager built
            off the main thread (a signal handler can only be installed on it).

    The rest is passed on to :class:`~unbroken.train.manager.Manager`.
    """
    check_state_pair(state_dict, load_state_dict)
    config = config or ReplicaConfig.from_env()
    device = device or torch.device("cpu")
    secret = secret or JobSecret.required()  # the job's key: the store, the donors and peers demand it
    backend = cross_replica_backend or env_cross_replica_backend()
    check_backend(backend, device)
    # How the sums travel (UNBROKEN_EXCHANGE): the backend's all-reduce, the ring, or ICCL.
    group = CrossReplicaGroup(secret, backend=backend, transport=make_transport(exchange_mode()))
    # Peers on other nodes fetch from here: listen on the address that reaches the coordinator.
    catchup = CatchupServer(secret, host=local_address_towards(coordinator_host(config.coordinator)))
    recorder = FlightRecorder(config.replica_id, link_fault=link_fault) if recorder_enabled() else None
    group.recorder = recorder
    policy = parse_policy(anomaly_policy())
    signum = stack_signal() if stack_dump else None
    stack_file, stack_tmp = stack_dump_path(config) if signum is not None else ("", None)
    dump = install_stack_dump(stack_file, signum) if signum is not None else None
    owned = RankResources(dump, stack_tmp)
    if config.world_size > 1 and not dist.is_initialized():  # the script's own group wins
        owned.replica_store = init_replica_group(config, secret, "gloo" if device.type == "cpu" else "nccl")
    voting = vote_device(dist.get_backend()) if config.world_size > 1 else torch.device("cpu")
    hint = DonateHint(config.replica_id)
    # No PID, stack file or signal in the hello: the process that started this rank
    # signals it and reads the stack file at the same path (unbroken.diagnosis.stacks).
    client = CoordinatorClient(
        config.coordinator,
        secret,
        hello={
            "replica": config.replica_id,
            "rank": config.rank,
            "world_size": config.world_size,
            "transfer_addr": catchup.address,
            "node": config.node,
        },
        on_abort=group.abort,
        on_donate=hint,
        on_prepare=lambda epoch, members, store: group.prepare(
            store, epoch, members, config.replica_id, f"rank{config.rank}", device
        ),
        telemetry=recorder.batch if recorder is not None else None,
    )

    manager = Manager(
        state_dict,
        load_state_dict,
        config=config,
        client=client,
        group=group,
        catchup=catchup,
        secret=secret,
        device=device,
        recorder=recorder,
        donate_hint=hint,
        vote_device=voting,
        deadline=deadline,
        max_attempts=max_attempts,
        quorum_timeout_s=quorum_timeout_s,
        prepare_early=prepare_early(),
        anomaly_policy=policy,
        fault_hook=fault_hook,
        on_shutdown=owned.close,  # the bound method keeps the stack dump's file open
        verify_exchange=verify_exchange(),
        weights_every=weight_check_every(),
    )
    client.wait_connected(connect_timeout_from_env(connect_timeout_s))
    return manager


def stack_dump_path(config: ReplicaConfig) -> tuple[str, str | None]:
    """Where this rank's stack dump goes: the run directory, or a private temporary one
    (removed at shutdown) for a process launched without one, never the working directory."""
    if run_dir_given() or config.run_dir not in (".", ""):
        return stack_path(config.run_dir, config.replica_id, config.rank), None
    tmp = tempfile.mkdtemp(prefix="unbroken-stacks-")
    return os.path.join(tmp, os.path.basename(stack_path(tmp, config.replica_id, config.rank))), tmp
