"""When a job must stop rather than loop: a configuration that can never work, or no progress.

The coordinator heals faults by forming new epochs, which is right for a crash, a hang or a
partition, and wrong for a setting that fails every epoch the same way: NCCL refusing two ranks
on one GPU looped through 1,279 epochs in 175 s, saying nothing, until the GPU ran out of
memory. Pure logic with time passed in:

* an epoch in which every member reported its exchange failed with a configuration error
  (:func:`unbroken.control.quorum.failure.classify`) is a fatal epoch; ``fatal_epochs`` of them in a
  row (no committed step, no epoch failed by a fault between them) stop the job, with the
  error, the members and a hint;
* a job that commits no step for ``no_progress_s`` (counted from its first quorum request or
  its last committed step) stops too, whatever the reason, instead of looping for hours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from unbroken.control.quorum.failure import FailureClass, classify

EXIT_CONFIG = 78  # EX_CONFIG: a configuration that can never work; fix it and run again
EXIT_NO_PROGRESS = 95  # no step committed for --no-progress-timeout seconds
DEFAULT_FATAL_EPOCHS = 3
DEFAULT_NO_PROGRESS_S = 900.0


@dataclasses.dataclass(frozen=True)
class JobStop:
    """Why the job ends.

    Attributes:
        cause: ``configuration`` or ``no_progress``.
        reason: the sentence a user reads.
        error: the error text the members reported (empty for no progress).
        members: the replicas of the last failed epoch.
        hint: what to change.
        exit_code: what ``unbroken run`` and the agents exit with.
    """

    cause: str
    reason: str
    error: str
    members: tuple[int, ...]
    hint: str
    exit_code: int


@dataclasses.dataclass
class JobHealth:
    """Fatal epochs in a row, and the time since the job last committed a step.

    Attributes:
        fatal_epochs: epochs in a row failed by a configuration error at every member that end
            the job (1 to 3).
        no_progress_s: seconds without a committed step that end the job; 0 never.
    """

    fatal_epochs: int = DEFAULT_FATAL_EPOCHS
    no_progress_s: float = DEFAULT_NO_PROGRESS_S
    streak: list[int] = dataclasses.field(default_factory=list)
    last_progress: float | None = None
    _epoch: int | None = None
    _members: frozenset[int] = frozenset()
    _reports: dict[int, tuple[str, FailureClass]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.fatal_epochs <= 3:
            raise ValueError(f"fatal epochs must be 1 to 3, got {self.fatal_epochs}")
        if not self.no_progress_s >= 0:  # also refuses NaN
            raise ValueError(f"the no-progress timeout must be >= 0 seconds (0: never), got {self.no_progress_s}")

    def asked(self, now: float) -> None:
        """A quorum request: the first one starts the no-progress clock."""
        if self.last_progress is None:
            self.last_progress = now

    def progressed(self, now: float) -> None:
        """A step was committed."""
        self.last_progress = now
        self.streak.clear()

    def failed(self, epoch: int, members: Iterable[int], replica: int, error: str | None) -> JobStop | None:
        """``replica``, a member of ``epoch``, reports its exchange in it failed with ``error``."""
        if epoch != self._epoch:
            self._epoch, self._members, self._reports = epoch, frozenset(members), {}
        if replica not in self._members or replica in self._reports:
            return None
        kind = classify(error) if error else FailureClass(fatal=False, cause="fault")
        self._reports[replica] = (error or "", kind)
        if not kind.fatal:
            self.streak.clear()  # a fault between them: not in a row
            return None
        if len(self._reports) < len(self._members) or epoch in self.streak:
            return None
        self.streak.append(epoch)
        if len(self.streak) < self.fatal_epochs:
            return None
        text, first = next(iter(self._reports.values()))
        return JobStop(
            cause="configuration",
            reason=(
                f"every member of {len(self.streak)} epochs in a row ({', '.join(map(str, self.streak))}) failed "
                f"with an error no retry can mend ({first.cause}): {first.hint}"
            ),
            error=text,
            members=tuple(sorted(self._members)),
            hint=first.hint,
            exit_code=EXIT_CONFIG,
        )

    def check(self, now: float, members: Iterable[int] = ()) -> JobStop | None:
        """The no-progress stop, when it is due."""
        if self.no_progress_s <= 0 or self.last_progress is None or now - self.last_progress <= self.no_progress_s:
            return None
        last = sorted(self._reports.items())
        errors = "; ".join(f"replica {r}: {text[:200]}" for r, (text, _) in last if text)
        return JobStop(
            cause="no_progress",
            reason=(
                f"no step committed for {now - self.last_progress:.0f}s (--no-progress-timeout "
                f"{self.no_progress_s:g}s)" + (f"; the last failures: {errors}" if errors else "")
            ),
            error=errors,
            members=tuple(sorted(members)),
            hint=(
                "look at the replicas' logs and the events for why no step commits (too few replicas "
                "alive for --min-replicas, a partition, a hang); raise --no-progress-timeout for a job "
                "whose first step is this slow"
            ),
            exit_code=EXIT_NO_PROGRESS,
        )
