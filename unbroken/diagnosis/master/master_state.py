"""What the diagnosis master keeps per rank, and the settings of its rules.

Kept apart from :mod:`unbroken.diagnosis.master.master` (the rules) so that each stays small.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Mapping

from unbroken.diagnosis.rules.steptime import STEP_TIME_THRESHOLD
from unbroken.diagnosis.telemetry import FlaggedLink

Ident = tuple[int, int]  # (replica, rank)


@dataclasses.dataclass
class MasterSettings:
    """Floors and factors of the learned thresholds, and the rules' windows."""

    hang_floor_s: float = 0.6
    hang_factor: float = 5.0
    hang_initial_s: float = 10.0
    silent_floor_s: float = 0.6
    silent_factor: float = 5.0
    # A rank is judged silent only once it has sent this many batches: a starting process
    # (imports, the first garbage collections, a first allocation of its model) can hold the GIL
    # for longer than the floor on a busy host, and a verdict then restarts a healthy replica.
    # A hang that early is still caught by the collective wait (``hang_initial_s``).
    silent_min_batches: int = 5
    # A rank is blamed for holding a collective up from outside it (noncomm_hang) only once it
    # has completed this many collectives since it connected. A restarted replica catches up in
    # one exchange and then runs its first trained step cold (allocations, a compile, a CUDA
    # context): blaming it restarts it into the same cold start, a loop that never ends. The
    # survivors do not wait for it meanwhile: the exchange deadline routes around it.
    warmup_collectives: int = 2
    straggler_window: int = 10
    straggler_threshold: float = 0.72
    link_window: int = 16  # transfers per cell: 8 collectives, as each direction carries every other one
    link_min_samples: int = 12
    # Transfers per cell whose stalls count (links.classify_stalling): a lossy link stalls one or
    # two in 16, and counted over 16 its finding came and went before it could hold.
    link_stall_window: int = 64
    # A link's fastest quarter over the reference links' slowest quarter (unbroken.diagnosis.rules.links):
    # healthy links of a loaded 2-core host scored 1.23 at worst over ~1100 evaluations of clean
    # ring runs, with and without a CPU hog; an injected 60 MB/s wire scores 17-25.
    link_ratio: float = 2.5
    link_quantile: float = 0.25
    link_warmup: int = 15  # a group's first collectives (connection setup, warm caches) are uneven
    confirm: int = 3  # new collectives a step-time finding must hold over
    # A replica's step-time shift score (unbroken.diagnosis.rules.steptime.gated_score: the smaller of
    # its recent/baseline median and fastest-quarter ratios, 0 unless alone and the pace moved),
    # held over ``confirm`` collectives, at or above which it is a step-time change.
    step_time_threshold: float = STEP_TIME_THRESHOLD
    # A straggler finding must hold longer: a 2-core CI machine once kept one clean replica
    # 1.4x slower than its own best, and last at every collective, for 13 collectives.
    straggler_confirm: int = 6
    link_confirm: int = 5  # new collectives a slow-connection finding must hold over
    # Groups (epochs) per rank whose counters and failed waits are kept: a hang is judged at a
    # rank's latest group, and a stall's members are gone from older ones.
    group_window: int = 4


@dataclasses.dataclass(frozen=True)
class OpenCollective:
    """The collective a rank is inside now, its entry on the coordinator's clock."""

    group: str
    seq: int
    enter: float


@dataclasses.dataclass(frozen=True)
class OpenRecv:
    """A ring receive still outstanding, posted at ``post`` on the coordinator's clock."""

    group: str
    seq: int
    peer: int
    ring_step: int
    post: float


@dataclasses.dataclass
class RankState:
    node: str
    last_seen: float
    offset_s: float | None = None
    gaps: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=100))
    entered: dict[str, int] = dataclasses.field(default_factory=dict)
    exits: dict[str, dict[int, tuple[float, float]]] = dataclasses.field(
        default_factory=dict
    )  # seq -> (exit, run-queue wait)
    open: OpenCollective | None = None
    failed: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)  # group -> seq, enter
    latest: str = ""
    completed: int = 0  # collectives completed since this rank connected
    open_recvs: list[OpenRecv] = dataclasses.field(default_factory=list)
    # group -> the furthest ring step of its open transfers, sends or receives (how far it got)
    open_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    flags: list[FlaggedLink] = dataclasses.field(default_factory=list)


class RankOffsets(Mapping[Ident, float]):
    """Each rank's clock offset to the coordinator's, where known: a live view of the ranks,
    read per transfer without copying every rank's (thousands of them at scale)."""

    def __init__(self, ranks: Mapping[Ident, RankState]) -> None:
        self._ranks = ranks

    def __getitem__(self, ident: Ident) -> float:
        off = self._ranks[ident].offset_s
        if off is None:
            raise KeyError(ident)
        return off

    def __iter__(self) -> Iterator[Ident]:
        return (i for i, r in self._ranks.items() if r.offset_s is not None)

    def __len__(self) -> int:
        return sum(1 for r in self._ranks.values() if r.offset_s is not None)
