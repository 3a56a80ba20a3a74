"""Typed settings. Every environment variable unbroken reads or sets is named here.

The launcher writes these into each worker's environment; ``unbroken.init()`` reads them back,
so a training script needs no arguments of its own to join a fault-tolerant job. Every read of
the environment goes through a function here, which parses and checks the value and names the
variable in its error; a module elsewhere only copies the whole environment on to a child
process (which reads nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

ENV_COORDINATOR = "UNBROKEN_COORDINATOR"
ENV_REPLICA_ID = "UNBROKEN_REPLICA_ID"
ENV_NUM_REPLICAS = "UNBROKEN_NUM_REPLICAS"
ENV_RUN_DIR = "UNBROKEN_RUN_DIR"
ENV_LR_SCALING = "UNBROKEN_LR_SCALING"
ENV_NODE = "UNBROKEN_NODE"
ENV_RESTART_COUNT = "UNBROKEN_RESTART_COUNT"
# Where the job's checkpoints live (``unbroken run --checkpoint-dir``); unset: none.
ENV_CHECKPOINT_DIR = "UNBROKEN_CHECKPOINT_DIR"
# Set by the supervisor when it rolls the job back: load exactly this checkpoint step.
ENV_RESUME_STEP = "UNBROKEN_RESUME_STEP"
# "1" in a job with hot spares (``unbroken run --hot-spares``): a worker waits for its first
# quorum without a bound, since it may wait as a spare for a place until the job ends.
ENV_WAIT_TO_JOIN = "UNBROKEN_WAIT_TO_JOIN"
# The worker-side faults of this rank (JSON, see unbroken.faults.worker_chaos); unset: no chaos.
ENV_CHAOS = "UNBROKEN_CHAOS"
# A fault in the ring transport's links (see unbroken.faults.link), e.g. "0-2:mb_s=20:step=30".
ENV_LINK_FAULT = "UNBROKEN_LINK_FAULT"
# The cross-replica exchange: "backend" (the backend's all-reduce, the default) or "ring" (a
# CPU-driven ring with per-connection timings for link diagnosis, unbroken.comm.ring_allreduce).
ENV_EXCHANGE = "UNBROKEN_EXCHANGE"
EXCHANGES = ("backend", "ring", "iccl")
# The backend of the cross-replica group (``unbroken run --cross-replica-backend``): "auto" (the
# default: NCCL when every member of an epoch holds a distinct GPU, else Gloo), "nccl" or "gloo".
ENV_CROSS_REPLICA_BACKEND = "UNBROKEN_CROSS_REPLICA_BACKEND"
# Set by the launcher unless the user set it: NCCL's reaction to a failed or timed-out
# collective. 2 (clean up only) aborts the communicator and raises on the next wait; torch's
# default tears the process down, which would turn a peer's fault into this rank's crash.
ENV_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ASYNC_ERROR_HANDLING = "2"
# Seconds a rank waits for its first connection to the coordinator; overrides
# unbroken.init(connect_timeout_s=...).
ENV_CONNECT_TIMEOUT = "UNBROKEN_CONNECT_TIMEOUT"
# "0" turns the flight recorder off (measuring its overhead); diagnosis then sees nothing.
ENV_RECORDER = "UNBROKEN_RECORDER"
# "0" waits for the training thread before acting on a quorum answer (measuring what acting
# early saves): the new epoch's rendezvous and a catch-up fetch then start after the compute.
ENV_PREPARE_EARLY = "UNBROKEN_PREPARE_EARLY"
# "0" turns off the verified exchange: every member's fingerprints of each exchange's sums,
# compared before the step commits (unbroken.train.step.sdc_check). Default on.
ENV_VERIFY_EXCHANGE = "UNBROKEN_VERIFY_EXCHANGE"
# Every how many steps the replicas also compare fingerprints of their parameters and optimizer
# state (0: never); default WEIGHT_CHECK_EVERY.
ENV_WEIGHT_CHECK_EVERY = "UNBROKEN_WEIGHT_CHECK_EVERY"
WEIGHT_CHECK_EVERY = 100
# Actions for training-metric anomalies over the default policy, e.g.
# "loss_spike=rollback,memory_growth=none" (see unbroken.diagnosis.rules.metrics.parse_policy).
ENV_ANOMALY_POLICY = "UNBROKEN_ANOMALY_POLICY"
# The signal that makes a worker write every thread's stack (the hang diagnosis sends it):
# a name such as "SIGUSR2" or a number; "none" turns the stack dump off. Default SIGUSR1.
ENV_STACK_SIGNAL = "UNBROKEN_STACK_SIGNAL"
# A file (mode 0600) holding the job's secret key, for unbroken.wire.auth.
ENV_SECRET_FILE = "UNBROKEN_SECRET_FILE"
# The standard torch.distributed variables, scoped to one replica group.
ENV_RANK = "RANK"
# torchft's launch lines name a worker's replica group in this (torchtitan reads it too)
ENV_REPLICA_GROUP_ID = "REPLICA_GROUP_ID"
ENV_NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
# What torchrun also sets, so a script written for torchrun runs under ``unbroken run`` unchanged.
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ENV_ROLE_RANK = "ROLE_RANK"
ENV_ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
ENV_TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
# Gloo's own choice of interface (a set one wins over unbroken's loopback default; a
# one-machine job's workers get loopback) and the intra-op thread count a worker inherits.
ENV_GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
# NCCL's choice of interface for its bootstrap and socket transport: set to loopback for the
# workers of a one-machine job (``unbroken run``) unless the user chose one.
ENV_NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"
# Extended (never replaced) for the helper processes that must import this very package.
ENV_PYTHONPATH = "PYTHONPATH"


class ConfigError(ValueError):
    """A setting is missing or malformed; the message says what to set."""


class CrossReplicaBackend(str, enum.Enum):
    """The backend of the cross-replica group (``--cross-replica-backend``,
    ``UNBROKEN_CROSS_REPLICA_BACKEND``): its words are declared here and nowhere else, and
    :meth:`parse` is the one check of a user's choice, whichever door it came through."""

    AUTO = "auto"  # NCCL when every member of an epoch holds a distinct GPU, else Gloo
    NCCL = "nccl"
    GLOO = "gloo"

    @classmethod
    def parse(cls, value: str, name: str) -> CrossReplicaBackend:
        """``value`` as a backend; a :class:`ConfigError` naming ``name`` (the flag or variable
        it came from) and the words it accepts otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{name} must be one of {', '.join(CROSS_REPLICA_BACKENDS)}, got {value!r}") from None


CROSS_REPLICA_BACKENDS = tuple(b.value for b in CrossReplicaBackend)


def parse_host_port(value: str, what: str = "address") -> tuple[str, int]:
    """Parses ``HOST:PORT``; a clear error names the setting that is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must look like HOST:PORT (e.g. 127.0.0.1:29510), got {value!r}")
    return host, int(port)


def parse_host_ports(value: str, what: str = "address") -> list[tuple[str, int]]:
    """Parses ``HOST:PORT[,HOST:PORT...]``: a coordinator and its standbys, tried in turn."""
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or any(not p for p in parts):
        raise ConfigError(f"{what} must be HOST:PORT or a comma-separated list of them, got {value!r}")
    return [parse_host_port(p, what) for p in parts]


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _switch(name: str, env: Mapping[str, str] | None) -> bool:
    """An on/off variable that is on unless set to ``0``."""
    return _environ(env).get(name, "1") != "0"


def prepare_early(env: Mapping[str, str] | None = None) -> bool:
    """``UNBROKEN_PREPARE_EARLY``: act on a quorum answer as soon as it arrives (default on)."""
    return _switch(ENV_PREPARE_EARLY, env)


def verify_exchange(env: Mapping[str, str] | None = None) -> bool:
    """``UNBROKEN_VERIFY_EXCHANGE``: compare each exchange's sums across replicas (default on)."""
    return _switch(ENV_VERIFY_EXCHANGE, env)


def weight_check_every(env: Mapping[str, str] | None = None) -> int:
    """``UNBROKEN_WEIGHT_CHECK_EVERY``: steps between weight comparisons (0: never)."""
    raw = _environ(env).get(ENV_WEIGHT_CHECK_EVERY, str(WEIGHT_CHECK_EVERY))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{ENV_WEIGHT_CHECK_EVERY} must be a whole number of steps >= 0 (0: never), got {raw!r}")
    return value


def recorder_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``UNBROKEN_RECORDER``: keep the flight recorder (default on)."""
    return _switch(ENV_RECORDER, env)


def anomaly_policy(env: Mapping[str, str] | None = None) -> str:
    """``UNBROKEN_ANOMALY_POLICY``, unparsed (``unbroken.diagnosis.rules.metrics.parse_policy``); '' unset."""
    return _environ(env).get(ENV_ANOMALY_POLICY, "")


def chaos_spec(env: Mapping[str, str] | None = None) -> str | None:
    """``UNBROKEN_CHAOS``: this rank's worker faults as the launcher wrote them; None unset."""
    return _environ(env).get(ENV_CHAOS) or None


def link_fault_spec(env: Mapping[str, str] | None = None) -> str | None:
    """``UNBROKEN_LINK_FAULT``, unparsed (``unbroken.faults.link.LinkFault.parse``); None unset."""
    return _environ(env).get(ENV_LINK_FAULT) or None


def exchange_mode(env: Mapping[str, str] | None = None) -> str:
    """``UNBROKEN_EXCHANGE``: ``backend`` (default), ``ring`` or ``iccl`` (:mod:`unbroken.comm.iccl`)."""
    mode = _environ(env).get(ENV_EXCHANGE, "backend")
    if mode not in EXCHANGES:
        raise ConfigError(f"{ENV_EXCHANGE} must be 'backend' or 'ring' or 'iccl', got {mode!r}")
    return mode


def cross_replica_backend(env: Mapping[str, str] | None = None) -> str:
    """``UNBROKEN_CROSS_REPLICA_BACKEND``: ``auto`` (default), ``nccl`` or ``gloo``."""
    value = _environ(env).get(ENV_CROSS_REPLICA_BACKEND, "auto") or "auto"
    return CrossReplicaBackend.parse(value, ENV_CROSS_REPLICA_BACKEND).value


def nccl_async_error_handling(env: Mapping[str, str] | None = None) -> str:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for the workers: the user's, else clean-up only."""
    return _environ(env).get(ENV_NCCL_ASYNC_ERROR_HANDLING) or NCCL_ASYNC_ERROR_HANDLING


def check_seconds(values: Mapping[str, float], zero_ok: bool = False) -> None:
    """Refuses, naming each, the values that are not a finite number of seconds > 0 (>= 0 with
    ``zero_ok``). Written as what a value must be, so that NaN, which every comparison fails,
    is refused too (``x <= 0`` lets it through).

    Raises:
        ConfigError: what is wrong and what was given.
    """
    bad = [
        f"{name}={value!r}"
        for name, value in values.items()
        if not (isinstance(value, (int, float)) and (value >= 0 if zero_ok else value > 0) and value < float("inf"))
    ]
    if bad:
        raise ConfigError(f"must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}: {', '.join(bad)}")


def connect_timeout_s(default: float, env: Mapping[str, str] | None = None) -> float:
    """``UNBROKEN_CONNECT_TIMEOUT`` in seconds when set, else ``default``."""
    raw = _environ(env).get(ENV_CONNECT_TIMEOUT)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{ENV_CONNECT_TIMEOUT} must be a number of seconds > 0, got {raw!r}")
    return value


def run_dir_given(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``UNBROKEN_RUN_DIR`` names a run directory (the launcher always sets it)."""
    return bool(_environ(env).get(ENV_RUN_DIR))


def observation_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``UNBROKEN_RUN_DIR`` as given (None when unset or blank): where a benchmark's worker
    leaves what it observed, also when torchft launched it."""
    return _environ(env).get(ENV_RUN_DIR) or None


def replica_group(env: Mapping[str, str] | None = None) -> str | None:
    """The replica group a worker runs: ``UNBROKEN_REPLICA_ID`` (``unbroken run``), else
    torchft's ``REPLICA_GROUP_ID``; None when neither is set."""
    e = _environ(env)
    return e.get(ENV_REPLICA_ID) or e.get(ENV_REPLICA_GROUP_ID) or None


def global_rank(env: Mapping[str, str] | None = None) -> int:
    """``RANK`` as torchrun sets it (0 when unset)."""
    return int(_environ(env).get(ENV_RANK, "0"))


def secret_file(env: Mapping[str, str] | None = None) -> str | None:
    """``UNBROKEN_SECRET_FILE``, stripped; None when unset or blank."""
    return _environ(env).get(ENV_SECRET_FILE, "").strip() or None


def gloo_socket_ifname(env: Mapping[str, str] | None = None) -> str | None:
    """``GLOO_SOCKET_IFNAME`` when the user chose Gloo's interface; None otherwise."""
    return _environ(env).get(ENV_GLOO_SOCKET_IFNAME) or None


@contextlib.contextmanager
def gloo_interface(ifname: str | None) -> Iterator[None]:
    """``GLOO_SOCKET_IFNAME`` set to ``ifname`` while a group is built, then unset again.

    torch's default group takes Gloo's device from the environment only (its options are not
    passed on), and without it binds what the host name resolves to, which may be an address
    other nodes reach. The user's own choice stays; ``None`` changes nothing.
    """
    if ifname is None or os.environ.get(ENV_GLOO_SOCKET_IFNAME):
        yield
        return
    os.environ[ENV_GLOO_SOCKET_IFNAME] = ifname
    try:
        yield
    finally:
        os.environ.pop(ENV_GLOO_SOCKET_IFNAME, None)


def omp_num_threads(default: int, env: Mapping[str, str] | None = None) -> str:
    """The ``OMP_NUM_THREADS`` a worker gets: the one set around us wins over ``default``."""
    return _environ(env).get(ENV_OMP_NUM_THREADS, str(default))


def python_path(env: Mapping[str, str] | None = None) -> str | None:
    """The ``PYTHONPATH`` set around us; None when unset or empty."""
    return _environ(env).get(ENV_PYTHONPATH) or None


def executable_path(env: Mapping[str, str] | None = None) -> str:
    """The ``PATH`` set around us (where programs we start are looked up); "" when unset."""
    return _environ(env).get("PATH", "")


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_RANK`` (0 when unset): which of this node's devices a rank takes."""
    raw = _environ(env).get(ENV_LOCAL_RANK, "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_LOCAL_RANK} must be an integer, got {raw!r}") from None


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (1 when unset): how many ranks share this node's devices."""
    raw = _environ(env).get(ENV_LOCAL_WORLD_SIZE, "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_LOCAL_WORLD_SIZE} must be an integer, got {raw!r}") from None


def master_address(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """torch.distributed's ``(MASTER_ADDR, MASTER_PORT)``; None unless both are set."""
    e = _environ(env)
    if ENV_MASTER_ADDR not in e or ENV_MASTER_PORT not in e:
        return None
    return e[ENV_MASTER_ADDR], e[ENV_MASTER_PORT]


def is_stack_signal(number: int) -> bool:
    """Whether ``number`` may be sent to ask for a stack dump: the user signals and the real-time
    ones, whose default action no program relies on (never one that stops or ends the process)."""
    return number in (signal.SIGUSR1, signal.SIGUSR2) or signal.SIGRTMIN <= number <= signal.SIGRTMAX


def stack_signal(env: Mapping[str, str] | None = None) -> int | None:
    """The signal named by ``UNBROKEN_STACK_SIGNAL`` (default SIGUSR1); None when turned off.

    Configurable because Slurm and Lightning use SIGUSR1 themselves; the handler chains to
    theirs either way.
    """
    raw = _environ(env).get(ENV_STACK_SIGNAL, "").strip()
    if not raw:
        return int(signal.SIGUSR1)
    if raw.lower() in ("none", "off", "0"):
        return None
    if raw.isdigit():
        number = int(raw)
    else:
        name = raw.upper() if raw.upper().startswith("SIG") else "SIG" + raw.upper()
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals):
            raise ConfigError(f"{ENV_STACK_SIGNAL} must name a signal (e.g. SIGUSR2) or be 'none', got {raw!r}")
        number = int(sig)
    if not is_stack_signal(number):
        raise ConfigError(
            f"{ENV_STACK_SIGNAL}={raw!r} cannot carry a stack dump: use SIGUSR1, SIGUSR2, "
            "a real-time signal (SIGRTMIN..SIGRTMAX) or 'none'"
        )
    return number


def coordinator_host(value: str) -> str:
    """The host of ``HOST:PORT[,HOST:PORT...]`` (a rank's coordinator addresses) whose route
    peers on other nodes share: the first that is not loopback, else the first.

    A node agent's relay (``unbroken agent``) comes first in its ranks' list, on loopback: the
    route to it is no address another node can dial, the route to the coordinator after it is.
    """
    hosts = [host for host, _ in parse_host_ports(value, ENV_COORDINATOR)]
    for host in hosts:
        if not is_loopback(host):  # a name is taken as it is (localhost aside)
            return host
    return hosts[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address, or ``localhost``: no other node can dial it."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: what peers on other nodes can dial.

    A loopback coordinator gives loopback, so single-machine jobs never listen beyond it.
    """
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """Where this process sits in the job.

    Attributes:
        coordinator: ``HOST:PORT`` of the coordinator.
        replica_id: this replica group's id, 0..num_replicas-1 (spares may use higher ids).
        num_replicas: replicas the job is configured with (the "total" of LR scaling).
        rank: rank inside the replica group.
        world_size: ranks per replica group.
        run_dir: where logs and metrics of this run go.
        lr_scaling: scale the learning rate by sqrt(healthy/total) while replicas are missing.
        node: the host name reported in events and diagnosis.
        restart_count: how many times the launcher restarted this replica.
        checkpoint_dir: the job's checkpoint directory, if it has one.
        resume_step: the checkpoint step to resume from when the supervisor rolled the job
            back; None otherwise.
        wait_to_join: wait for the first quorum without a bound: in a job with hot spares this
            replica may wait, parked, for a member's place (``unbroken run --hot-spares``).
    """

    coordinator: str
    replica_id: int
    num_replicas: int
    rank: int = 0
    world_size: int = 1
    run_dir: str = "."
    lr_scaling: bool = True
    node: str = "localhost"
    restart_count: int = 0
    checkpoint_dir: str | None = None
    resume_step: int | None = None
    wait_to_join: bool = False

    def __post_init__(self) -> None:
        parse_host_ports(self.coordinator, ENV_COORDINATOR)
        if self.num_replicas < 1:
            raise ConfigError(f"{ENV_NUM_REPLICAS} must be >= 1, got {self.num_replicas}")
        if self.replica_id < 0:
            raise ConfigError(f"{ENV_REPLICA_ID} must be >= 0, got {self.replica_id}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"{ENV_RANK} must be in [0, {ENV_WORLD_SIZE}={self.world_size}), got {self.rank}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaConfig:
        """Where this process sits, as its supervisor wrote it (:meth:`WorkerSettings.from_env`,
        checked whole), or, for a worker started by hand or by another launcher, from the few
        variables it must set (``UNBROKEN_COORDINATOR``, ``UNBROKEN_REPLICA_ID``,
        ``UNBROKEN_NUM_REPLICAS``) with defaults for the rest."""
        env = _environ(env)
        if supervised(env):
            return WorkerSettings.from_env(env).replica_config()
        if ENV_COORDINATOR not in env:
            raise ConfigError(
                f"{ENV_COORDINATOR} is not set: start the script with "
                "`unbroken run --replicas N -- python train.py` or set it to the coordinator's "
                "HOST:PORT"
            )

        def integer(name: str, default: int | None = None) -> int:
            raw = env.get(name)
            if raw is None:
                if default is None:
                    raise ConfigError(f"{name} is not set (the launcher sets it)")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name} must be an integer, got {raw!r}") from None

        return cls(
            coordinator=env[ENV_COORDINATOR],
            replica_id=integer(ENV_REPLICA_ID),
            num_replicas=integer(ENV_NUM_REPLICAS),
            rank=integer(ENV_RANK, 0),
            world_size=integer(ENV_WORLD_SIZE, 1),
            run_dir=env.get(ENV_RUN_DIR, "."),
            lr_scaling=_lr_scaling(env),
            node=env.get(ENV_NODE, os.uname().nodename),
            restart_count=integer(ENV_RESTART_COUNT, 0),
            checkpoint_dir=env.get(ENV_CHECKPOINT_DIR) or None,
            resume_step=integer(ENV_RESUME_STEP) if env.get(ENV_RESUME_STEP) else None,
            wait_to_join=env.get(ENV_WAIT_TO_JOIN) == "1",
        )


@dataclasses.dataclass(frozen=True)
class GroupPlace:
    """Where this node's ranks sit in a replica group that spans ``nodes`` nodes.

    Attributes:
        group_rank: this node's index in the group (``GROUP_RANK``).
        nodes: nodes in the group (``GROUP_WORLD_SIZE``).
        master_addr: the address of group rank 0's node, where the group rendezvouses.
        master_port: the port group rank 0 picked there.
        ifname: the interface of this node's advertised address, for Gloo (None: Gloo's default).
    """

    group_rank: int
    nodes: int
    master_addr: str
    master_port: int
    ifname: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """Everything a supervisor (``unbroken run``, ``unbroken agent``) hands one worker, as one type.

    The supervisor writes it (:meth:`to_env`) and the worker reads it back (:meth:`from_env`):
    one list of fields instead of a function's keywords plus an untyped dict of extras, so a
    new setting is added in one place and a bad value is refused here, naming what to fix.

    Attributes:
        coordinator: what the worker dials (``UNBROKEN_COORDINATOR``): HOST:PORT, or a list.
        secret_file: the job's secret file; its path travels, never the key (an environment
            shows in ``/proc/PID/environ``, core dumps and scheduler logs).
        replica: the replica group's id.
        num_replicas: replicas the job is configured with.
        run_dir: the job's run directory (its name is torchrun's ``TORCHELASTIC_RUN_ID``).
        restarts: how often this replica was restarted.
        node: the node's name.
        rank: the rank's index on this node (``LOCAL_RANK``; ``RANK`` too unless ``group``).
        world_size: ranks in the replica group, over all its nodes.
        master_port: the group's rendezvous port on this node's loopback (``group`` None).
        threads: ``OMP_NUM_THREADS`` unless the supervisor's environment sets one.
        group: where this node sits in a replica group spanning nodes; None: all on this node.
        cross_replica_backend: the backend chosen on the command line; None leaves the
            environment's.
        checkpoint_dir: the job's checkpoint directory, if it has one.
        resume_step: the checkpoint step a rollback restarts this replica from.
        anomaly_policy: actions for training-metric anomalies ("" the default policy).
        python_path: ``PYTHONPATH`` for the worker (``--torchft-compat``); None leaves the
            environment's.
        chaos: this rank's worker-side faults (JSON, :mod:`unbroken.faults.worker_chaos`); None: none.
        lr_scaling: scale the learning rate while replicas are missing (``UNBROKEN_LR_SCALING``;
            off when the supervisor's environment sets it to 0).
        wait_to_join: the job has hot spares: the worker waits for its first quorum without a
            bound (``UNBROKEN_WAIT_TO_JOIN``).
        replica_groups: every replica group the job starts, hot spares included (None:
            ``num_replicas``). With ``replica``, written as torchft's ``NUM_REPLICA_GROUPS`` and
            ``REPLICA_GROUP_ID``, which torchft's examples read to pick their data shard.
    """

    coordinator: str
    secret_file: Path
    replica: int
    num_replicas: int
    run_dir: Path
    restarts: int
    node: str
    rank: int
    world_size: int
    master_port: int
    threads: int
    group: GroupPlace | None = None
    cross_replica_backend: CrossReplicaBackend | None = None
    checkpoint_dir: Path | None = None
    resume_step: int | None = None
    anomaly_policy: str = ""
    python_path: str | None = None
    chaos: str | None = None
    lr_scaling: bool = True
    wait_to_join: bool = False
    replica_groups: int | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"{ENV_NUM_REPLICAS} must be >= 1, got {self.num_replicas}")
        if self.replica < 0:
            raise ConfigError(f"{ENV_REPLICA_ID} must be >= 0, got {self.replica}")
        if self.restarts < 0:
            raise ConfigError(f"{ENV_RESTART_COUNT} must be >= 0, got {self.restarts}")
        if self.world_size < 1:
            raise ConfigError(f"{ENV_WORLD_SIZE} must be >= 1, got {self.world_size}")
        if self.threads < 1:
            raise ConfigError(f"{ENV_OMP_NUM_THREADS} must be >= 1, got {self.threads}")
        if self.group is not None and (self.group.nodes < 1 or self.world_size % self.group.nodes):
            raise ConfigError(
                f"{ENV_WORLD_SIZE} {self.world_size} must be a multiple of {ENV_GROUP_WORLD_SIZE} "
                f"{self.group.nodes}: every node of a replica group runs as many ranks"
            )
        if not 0 <= self.rank < self.local_world_size:
            raise ConfigError(
                f"{ENV_LOCAL_RANK} must be in [0, {ENV_LOCAL_WORLD_SIZE}={self.local_world_size}), got {self.rank}"
            )
        if self.resume_step is not None and self.resume_step < 0:
            raise ConfigError(f"{ENV_RESUME_STEP} must be >= 0, got {self.resume_step}")

    @property
    def local_world_size(self) -> int:
        """Ranks of the replica group on this node."""
        return self.world_size // self.group.nodes if self.group is not None else self.world_size

    @property
    def global_rank(self) -> int:
        """The rank in the whole replica group, across its nodes (``RANK``)."""
        return self.group.group_rank * self.local_world_size + self.rank if self.group is not None else self.rank

    def replica_config(self) -> ReplicaConfig:
        """Where the worker sits in the job, as the training side needs it."""
        return ReplicaConfig(
            coordinator=self.coordinator,
            replica_id=self.replica,
            num_replicas=self.num_replicas,
            rank=self.global_rank,
            world_size=self.world_size,
            run_dir=str(self.run_dir),
            lr_scaling=self.lr_scaling,
            node=self.node,
            restart_count=self.restarts,
            checkpoint_dir=str(self.checkpoint_dir) if self.checkpoint_dir is not None else None,
            resume_step=self.resume_step,
            wait_to_join=self.wait_to_join,
        )

    def to_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What the worker sees: ``environ`` (the supervisor's), PyTorch's variables inside its
        replica group as torchrun sets them, and unbroken's own.

        A replica group on one node (``group`` None) rendezvouses on this node's loopback, and
        torchrun's view of it is one node (``GROUP_RANK`` 0), whose restarts are this replica's.
        A group spanning nodes rendezvouses at the address its group rank 0 node advertised,
        and Gloo is pinned to the interface of this node's advertised address unless
        ``environ`` chose one. NCCL is told to clean up a failed collective rather than tear the
        process down (unless ``environ`` says otherwise): a peer's fault must fail this rank's
        exchange, which the next epoch heals, not kill the rank.
        """
        restarts = str(self.restarts)
        out = {
            **environ,
            ENV_COORDINATOR: self.coordinator,
            ENV_SECRET_FILE: str(Path(self.secret_file).resolve()),
            ENV_REPLICA_ID: str(self.replica),
            ENV_NUM_REPLICAS: str(self.num_replicas),
            ENV_REPLICA_GROUP_ID: str(self.replica),
            ENV_NUM_REPLICA_GROUPS: str(self.replica_groups or self.num_replicas),
            ENV_RUN_DIR: str(self.run_dir),
            ENV_RESTART_COUNT: restarts,
            ENV_NODE: self.node,
            ENV_RANK: str(self.rank),
            ENV_LOCAL_RANK: str(self.rank),
            ENV_WORLD_SIZE: str(self.world_size),
            ENV_MASTER_ADDR: "127.0.0.1",
            ENV_MASTER_PORT: str(self.master_port),
            ENV_LOCAL_WORLD_SIZE: str(self.world_size),
            ENV_GROUP_RANK: "0",
            ENV_GROUP_WORLD_SIZE: "1",
            ENV_ROLE_RANK: str(self.rank),
            ENV_ROLE_WORLD_SIZE: str(self.world_size),
            ENV_TORCHELASTIC_RESTART_COUNT: restarts,
            ENV_TORCHELASTIC_RUN_ID: Path(self.run_dir).resolve().name,  # one id for the whole job
            ENV_OMP_NUM_THREADS: omp_num_threads(self.threads, environ),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crashing worker leaves its stack in the log
            ENV_NCCL_ASYNC_ERROR_HANDLING: nccl_async_error_handling(environ),
        }
        if self.cross_replica_backend is not None:
            out[ENV_CROSS_REPLICA_BACKEND] = self.cross_replica_backend.value
        g = self.group
        if g is not None:
            out.update(
                {
                    ENV_RANK: str(self.global_rank),
                    ENV_GROUP_RANK: str(g.group_rank),
                    ENV_GROUP_WORLD_SIZE: str(g.nodes),
                    ENV_ROLE_RANK: str(self.global_rank),
                    ENV_LOCAL_WORLD_SIZE: str(self.local_world_size),
                    ENV_MASTER_ADDR: g.master_addr,
                    ENV_MASTER_PORT: str(g.master_port),
                }
            )
            if g.ifname and gloo_socket_ifname(environ) is None:
                out[ENV_GLOO_SOCKET_IFNAME] = g.ifname
        if self.chaos is not None:
            out[ENV_CHAOS] = self.chaos
        if self.checkpoint_dir is not None:
            out[ENV_CHECKPOINT_DIR] = str(self.checkpoint_dir)
        if self.resume_step is not None:
            out[ENV_RESUME_STEP] = str(self.resume_step)
        if self.anomaly_policy:
            out[ENV_ANOMALY_POLICY] = self.anomaly_policy
        if self.python_path is not None:
            out[ENV_PYTHONPATH] = self.python_path
        if not self.lr_scaling:
            out[ENV_LR_SCALING] = "0"
        if self.wait_to_join:
            out[ENV_WAIT_TO_JOIN] = "1"
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """The settings a supervisor wrote with :meth:`to_env`; a :class:`ConfigError` naming the
        variable when one is missing or malformed. With a group spanning nodes, ``master_port``
        is the group's (the one the worker dials). ``python_path`` is read back as ``PYTHONPATH``."""

        def text(name: str) -> str:
            if name not in env:
                raise ConfigError(f"{name} is not set (the supervisor sets it: start the worker with `unbroken run`)")
            return env[name]

        def integer(name: str) -> int:
            raw = text(name)
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name} must be an integer, got {raw!r}") from None

        nodes = integer(ENV_GROUP_WORLD_SIZE)
        group = None
        if nodes > 1:
            group = GroupPlace(
                integer(ENV_GROUP_RANK), nodes, text(ENV_MASTER_ADDR), integer(ENV_MASTER_PORT), gloo_socket_ifname(env)
            )
        backend = env.get(ENV_CROSS_REPLICA_BACKEND)
        groups = integer(ENV_NUM_REPLICA_GROUPS) if env.get(ENV_NUM_REPLICA_GROUPS) else None
        return cls(
            coordinator=text(ENV_COORDINATOR),
            secret_file=Path(text(ENV_SECRET_FILE)),
            replica=integer(ENV_REPLICA_ID),
            num_replicas=integer(ENV_NUM_REPLICAS),
            run_dir=Path(text(ENV_RUN_DIR)),
            restarts=integer(ENV_RESTART_COUNT),
            node=text(ENV_NODE),
            rank=integer(ENV_LOCAL_RANK),
            world_size=integer(ENV_WORLD_SIZE),
            master_port=integer(ENV_MASTER_PORT),
            threads=integer(ENV_OMP_NUM_THREADS),
            group=group,
            cross_replica_backend=CrossReplicaBackend.parse(backend, ENV_CROSS_REPLICA_BACKEND) if backend else None,
            checkpoint_dir=Path(env[ENV_CHECKPOINT_DIR]) if env.get(ENV_CHECKPOINT_DIR) else None,
            resume_step=integer(ENV_RESUME_STEP) if env.get(ENV_RESUME_STEP) else None,
            anomaly_policy=env.get(ENV_ANOMALY_POLICY, ""),
            python_path=env.get(ENV_PYTHONPATH) or None,
            chaos=env.get(ENV_CHAOS) or None,
            lr_scaling=_lr_scaling(env),
            wait_to_join=env.get(ENV_WAIT_TO_JOIN) == "1",
            replica_groups=groups if groups != integer(ENV_NUM_REPLICAS) else None,
        )


def supervised(env: Mapping[str, str] | None = None) -> bool:
    """Whether a supervisor (``unbroken run``, ``unbroken agent``) wrote this environment with
    :meth:`WorkerSettings.to_env`: it always sets ``UNBROKEN_RESTART_COUNT``, which a worker
    started by hand or by another launcher has no reason to."""
    return ENV_RESTART_COUNT in _environ(env)


def _lr_scaling(env: Mapping[str, str]) -> bool:
    return env.get(ENV_LR_SCALING, "1") not in ("0", "false", "False")


# -- ICCL exchange (UNBROKEN_EXCHANGE=iccl, unbroken.comm.iccl) -------------------------------
ENV_ICCL_PATHS = "UNBROKEN_ICCL_PATHS"
ENV_ICCL_STALL = "UNBROKEN_ICCL_STALL_S"
ENV_ICCL_CORRUPT = "UNBROKEN_ICCL_CORRUPT"  # fault injection (benchmarks): LIMIT[/EVERY] chunks


def iccl_paths(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``UNBROKEN_ICCL_PATHS``: ``PRIMARY,BACKUP``, each an interface name (``eth0``) or an IPv4
    address of this host; None when unset (both paths on the address towards the store)."""
    raw = _environ(env).get(ENV_ICCL_PATHS)
    if not raw:
        return None
    parts = [x.strip() for x in raw.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{ENV_ICCL_PATHS} must be PRIMARY,BACKUP (interface names or addresses), got {raw!r}")
    return parts[0], parts[1]


def iccl_stall_s(env: Mapping[str, str] | None = None) -> float:
    """``UNBROKEN_ICCL_STALL_S``: how long a path may stall before its hop moves (default 0.3)."""
    raw = _environ(env).get(ENV_ICCL_STALL, "0.3")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 60.0:
        raise ConfigError(f"{ENV_ICCL_STALL} must be seconds between 0.05 and 60, got {raw!r}")
    return value


def iccl_corrupt(env: Mapping[str, str] | None = None) -> str | None:
    """``UNBROKEN_ICCL_CORRUPT``: a benchmark's injected NIC corruption (``LIMIT[/EVERY]``); None off."""
    return _environ(env).get(ENV_ICCL_CORRUPT) or None
