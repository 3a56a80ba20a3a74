"""The fault schedule: what fault, when (a step or a time), on which replica, rank or link.

The same schedule drives the tests, the benchmarks and the demo. A schedule is a list of
:class:`Fault` read from a YAML/JSON file or from repeatable ``--fault`` flags::

    --fault crash:replica=1,step=40
    --fault hang:replica=2,step=80,duration_s=5
    --fault slow_rank:replica=0,factor=3,step=100,duration_s=20
    --fault slow_link:link=0-2,mb_s=20,step=10
    --fault nan_loss:replica=1,step=50
    --fault coordinator_kill:at_s=30,duration_s=1
    --fault disk_full:replica=0,step=20
    --fault bitflip:replica=1,step=30,where=result,bit=22

Faults split by who applies them. The supervisor applies the ones that act on processes
(:data:`SUPERVISOR_KINDS`): ``crash`` is ``kill -9`` of one rank, ``hang`` is ``SIGSTOP``
(and ``SIGCONT`` after ``duration_s`` when given), ``coordinator_kill`` stops the in-process
coordinator abruptly and starts a fresh one on the same port and state after ``duration_s``,
and ``disk_full`` lowers ``RLIMIT_FSIZE`` of the replica's checkpoint writer processes (the
``unbroken.checkpoint.persist`` children) to ``limit_mb`` so that the kernel fails their
writes (``EFBIG``, the same failure mode as a full disk: a write that stops mid-file), while
the training process and its logs are untouched; the limit is lifted after ``duration_s``
(:mod:`unbroken.faults.supervisor` holds the process-level means).

The worker applies the ones that act on the training itself (:data:`WORKER_KINDS`), through
:class:`~unbroken.faults.worker_chaos.WorkerChaos`, which the launcher hands over in the
:data:`~unbroken.config.ENV_CHAOS` environment variable and the
:class:`~unbroken.train.manager.Manager` calls, as its fault hook, at the step start and before
each exchange: ``slow_rank`` makes the rank sleep ``(factor - 1)`` times its own
compute time every step; ``slow_link`` delays both ends of the link by
``bytes / (mb_s * 1e6)`` seconds before every exchange in which both are members;
``nan_loss`` turns the loss the training loop reports (:meth:`WorkerChaos.loss`) into NaN
and, with ``poison_grads=true``, the gradients too; ``bitflip`` flips bit ``bit`` of element
``index`` of a gradient, the exchange's result, a weight or an optimizer moment (``where``,
:mod:`unbroken.faults.bitflip`), once, or at every step for ``duration_s``.

A worker fault is tied to the replica's home slot: when the supervisor moves the replica to a
spare slot the fault stays behind, as a slow GPU would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

SUPERVISOR_KINDS = frozenset({"crash", "hang", "coordinator_kill", "disk_full"})
WORKER_KINDS = frozenset({"slow_rank", "slow_link", "nan_loss", "bitflip"})
BITFLIP_WHERE = ("grad", "result", "weight", "moment")  # unbroken.faults.bitflip.WHERE
KINDS = SUPERVISOR_KINDS | WORKER_KINDS

# kind -> parameters it accepts beyond the common ones (step, at_s, duration_s).
_PARAMS: dict[str, frozenset[str]] = {
    "crash": frozenset({"replica", "rank"}),
    "hang": frozenset({"replica", "rank"}),
    "slow_rank": frozenset({"replica", "rank", "factor"}),
    "slow_link": frozenset({"link", "mb_s"}),
    "nan_loss": frozenset({"replica", "rank", "poison_grads"}),
    "coordinator_kill": frozenset(),
    "disk_full": frozenset({"replica", "limit_mb"}),
    "bitflip": frozenset({"replica", "rank", "where", "bit", "index"}),
}
_COMMON = frozenset({"kind", "step", "at_s", "duration_s", "name"})


class ScheduleError(ValueError):
    """A fault schedule is malformed; the message names the fault and what to fix."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault.

    Attributes:
        kind: one of :data:`KINDS`.
        step: fire when the job reaches this step (the highest step any replica started).
        at_s: fire this many seconds after the job started (exactly one of step/at_s).
        replica: the target replica (every kind but ``slow_link`` and ``coordinator_kill``).
        rank: the target rank inside the replica group.
        duration_s: how long the fault lasts; None: until the end (``hang``: never resumed).
        factor: ``slow_rank``: how many times slower the rank's compute becomes (> 1).
        link: ``slow_link``: the two replicas whose traffic is delayed.
        mb_s: ``slow_link``: the emulated bandwidth of that link, in MB/s.
        poison_grads: ``nan_loss``: also fill the gradients with NaN.
        limit_mb: ``disk_full``: bytes a checkpoint file may reach before writes fail.
        where: ``bitflip``: ``grad``, ``result``, ``weight`` or ``moment``.
        bit: ``bitflip``: which bit of the element (0 the least significant, 31 a float32's sign).
        index: ``bitflip``: which element of the tensor (wraps around its size).
        name: a label for reports; defaults to a description.
    """

    kind: str
    step: int | None = None
    at_s: float | None = None
    replica: int | None = None
    rank: int = 0
    duration_s: float | None = None
    factor: float | None = None
    link: tuple[int, int] | None = None
    mb_s: float | None = None
    poison_grads: bool = False
    limit_mb: float = 0.0
    where: str = ""
    bit: int = 22
    index: int = 0
    name: str = ""

    @property
    def one_step(self) -> bool:
        """A fault of one step (a NaN or a bit flip with no duration): replaying that step does
        not repeat it, as a transient error would not (a rolled-back job replays the step)."""
        return self.kind in ("nan_loss", "bitflip") and self.duration_s is None

    def __post_init__(self) -> None:
        where = f"fault {self.name or self.kind!r}"
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown fault kind {self.kind!r}: choose one of {', '.join(sorted(KINDS))}")
        if (self.step is None) == (self.at_s is None):
            raise ScheduleError(f"{where}: give exactly one trigger, step=N or at_s=SECONDS")
        if self.step is not None and (not isinstance(self.step, int) or self.step < 0):
            raise ScheduleError(f"{where}: step must be an integer >= 0, got {self.step!r}")
        if self.at_s is not None and not (self.at_s >= 0 and math.isfinite(self.at_s)):
            raise ScheduleError(f"{where}: at_s must be a number of seconds >= 0, got {self.at_s!r}")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ScheduleError(f"{where}: duration_s must be > 0 seconds, got {self.duration_s!r}")
        needs_replica = "replica" in _PARAMS[self.kind]
        if needs_replica and self.replica is None:
            raise ScheduleError(f"{where}: missing target, add replica=N")
        if self.replica is not None and not needs_replica:
            raise ScheduleError(f"{where}: {self.kind} takes no replica")
        if self.replica is not None and self.replica < 0:
            raise ScheduleError(f"{where}: replica must be >= 0, got {self.replica}")
        if self.rank < 0:
            raise ScheduleError(f"{where}: rank must be >= 0, got {self.rank}")
        if self.kind == "slow_rank" and (self.factor is None or not self.factor > 1 or not math.isfinite(self.factor)):
            raise ScheduleError(f"{where}: slow_rank needs factor > 1 (e.g. factor=3), got {self.factor!r}")
        if self.kind == "slow_link":
            if self.link is None or len(self.link) != 2 or self.link[0] == self.link[1] or min(self.link) < 0:
                raise ScheduleError(f"{where}: slow_link needs link=A-B with two different replicas, got {self.link!r}")
            if self.mb_s is None or not self.mb_s > 0:
                raise ScheduleError(
                    f"{where}: slow_link needs mb_s > 0 (the link's bandwidth in MB/s), got {self.mb_s!r}"
                )
        if self.kind == "bitflip":
            if self.where not in BITFLIP_WHERE:
                raise ScheduleError(
                    f"{where}: bitflip needs where= one of {', '.join(BITFLIP_WHERE)}, got {self.where!r}"
                )
            if not 0 <= self.bit < 64:
                raise ScheduleError(f"{where}: bit must be within 0..63 (31: a float32's sign), got {self.bit}")
            if self.index < 0:
                raise ScheduleError(f"{where}: index must be >= 0, got {self.index}")
        elif self.where:
            raise ScheduleError(f"{where}: {self.kind} takes no where")
        if self.limit_mb < 0:
            raise ScheduleError(f"{where}: limit_mb must be >= 0, got {self.limit_mb}")

    @property
    def label(self) -> str:
        """What a report shows: the name, or the kind, target and trigger."""
        if self.name:
            return self.name
        return f"{self.kind} {self.target} at {self.trigger}"

    @property
    def target(self) -> str:
        if self.kind == "slow_link" and self.link is not None:
            return f"link {self.link[0]}-{self.link[1]}"
        if self.kind == "coordinator_kill":
            return "coordinator"
        return f"replica {self.replica} rank {self.rank}"

    @property
    def trigger(self) -> str:
        return f"step {self.step}" if self.step is not None else f"{self.at_s:g}s"

    @property
    def replicas(self) -> tuple[int, ...]:
        """The replicas this fault touches."""
        if self.link is not None:
            return tuple(self.link)
        return (self.replica,) if self.replica is not None else ()

    def due(self, step: int, elapsed_s: float) -> bool:
        """Whether the trigger has been reached at job step ``step``, ``elapsed_s`` into the job."""
        if self.step is not None:
            return step >= self.step
        return elapsed_s >= (self.at_s or 0.0)

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from the defaults (what a schedule file would say)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "kind" or value != field.default:
                out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "fault") -> Fault:
        """Builds a fault from a dict (a file entry or a parsed flag), with clear errors."""
        if not isinstance(raw, Mapping):
            raise ScheduleError(f"{where}: expected a mapping like {{kind: crash, replica: 1, step: 40}}, got {raw!r}")
        kind = raw.get("kind")
        if kind is None:
            raise ScheduleError(f"{where}: missing kind (one of {', '.join(sorted(KINDS))})")
        if kind not in KINDS:
            raise ScheduleError(f"{where}: unknown fault kind {kind!r}: choose one of {', '.join(sorted(KINDS))}")
        allowed = _COMMON | _PARAMS[kind]
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ScheduleError(
                f"{where}: {kind} does not take {', '.join(unknown)}; it takes {', '.join(sorted(allowed - {'kind'}))}"
            )
        kwargs: dict[str, Any] = {"kind": kind}
        for key, value in raw.items():
            if key == "kind":
                continue
            kwargs[key] = _convert(key, value, where)
        return cls(**kwargs)


def _convert(key: str, value: Any, where: str) -> Any:
    try:
        if key in ("step", "replica", "rank", "bit", "index"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if key in ("at_s", "duration_s", "factor", "mb_s", "limit_mb"):
            text = str(value)
            return float(text[:-1] if key in ("at_s", "duration_s") and text.endswith("s") else text)
        if key == "link":
            parts = value.split("-") if isinstance(value, str) else list(value)
            a, b = (int(p) for p in parts)
            return (a, b)
        if key == "poison_grads":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes"):
                return True
            if str(value).lower() in ("0", "false", "no"):
                return False
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        hint = {"link": "two replica ids like 0-2", "poison_grads": "true or false"}.get(key, "a number")
        raise ScheduleError(f"{where}: {key}={value!r} is not valid; expected {hint}") from None


def parse_flag(text: str) -> Fault:
    """Parses one ``--fault KIND:key=value,...`` flag."""
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    raw: dict[str, Any] = {"kind": kind}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ScheduleError(f"--fault {text!r}: {item!r} should be key=value (e.g. crash:replica=1,step=40)")
        raw[key.strip()] = value.strip()
    return Fault.from_mapping(raw, where=f"--fault {text!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The faults of one run, in the order given."""

    faults: tuple[Fault, ...] = ()

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def validate(self, replicas: int, ranks_per_replica: int = 1, coordinator_in_process: bool = True) -> Schedule:
        """Checks every target exists in a job of this shape; returns self for chaining."""
        for f in self.faults:
            where = f"fault {f.label!r}"
            for r in f.replicas:
                if r >= replicas:
                    raise ScheduleError(f"{where}: replica {r} is out of range, the job has replicas 0..{replicas - 1}")
            if f.rank >= ranks_per_replica:
                raise ScheduleError(
                    f"{where}: rank {f.rank} is out of range, each replica has ranks 0..{ranks_per_replica - 1}"
                )
            if f.kind == "coordinator_kill" and not coordinator_in_process:
                raise ScheduleError(
                    f"{where}: coordinator_kill needs the coordinator that `unbroken run` starts itself"
                )
        return self

    def supervisor_faults(self) -> list[Fault]:
        return [f for f in self.faults if f.kind in SUPERVISOR_KINDS]

    def worker_faults(self, replica: int, rank: int) -> list[Fault]:
        """The worker-side faults a process of ``replica``/``rank`` applies to itself."""
        return [
            f
            for f in self.faults
            if f.kind in WORKER_KINDS and replica in f.replicas and (f.kind == "slow_link" or f.rank == rank)
        ]

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.faults]

    @classmethod
    def from_data(cls, data: Any, where: str = "schedule") -> Schedule:
        """Accepts a list of faults or ``{faults: [...]}``."""
        if isinstance(data, Mapping):
            extra = sorted(set(data) - {"faults"})
            if extra:
                raise ScheduleError(
                    f"{where}: unknown top-level keys {', '.join(extra)}; put the faults under 'faults:'"
                )
            data = data.get("faults") or []
        if not isinstance(data, list):
            raise ScheduleError(
                f"{where}: expected a list of faults (or a mapping with 'faults:'), got {type(data).__name__}"
            )
        return cls(tuple(Fault.from_mapping(item, f"{where}, fault #{i + 1}") for i, item in enumerate(data)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Schedule:
        """Reads a YAML or JSON schedule file."""
        import yaml

        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ScheduleError(f"cannot read the fault schedule {p}: {e.strerror}") from e
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ScheduleError(f"{p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
        return cls.from_data(data or [], where=str(p))

    @classmethod
    def build(cls, files: Iterable[str | os.PathLike[str]] = (), flags: Sequence[str] = ()) -> Schedule:
        """Files first, then flags: what ``--faults FILE`` and ``--fault ...`` together give."""
        faults: list[Fault] = []
        for f in files:
            faults.extend(cls.load(f).faults)
        faults.extend(parse_flag(x) for x in flags)
        return cls(tuple(faults))
