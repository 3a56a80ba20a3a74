"""Restart and isolation policy: when to restart, when to stop, where to run.

Pure decisions over plain records, so every rule is tested without a process:

* a failed replica restarts after an exponential backoff that resets once it commits a step;
* limits per replica and per job bound the restarts;
* a job that commits no step across ``crash_loop_restarts`` restarts is crash-looping: it ends
  with :data:`EXIT_CRASH_LOOP` (93, the code NVIDIA's resiliency tools use) and a message,
  never an endless loop;
* a node blamed for ``blame_threshold`` faults within ``blame_window_s`` is isolated; its
  replicas move to a free slot on another node (spares first);
* an isolated node is re-admitted only after ``readmit_after_s`` and a passing self-check.
"""

from __future__ import annotations

import dataclasses
from collections import deque

EXIT_CRASH_LOOP = 93
EXIT_RESTART_LIMIT = 94


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """The knobs; defaults suit a CPU demo (seconds-long steps) and a real job alike.

    Attributes:
        backoff_initial_s: delay before the first restart after a run of progress.
        backoff_factor: growth per further failure without progress.
        backoff_max_s: the delay never exceeds this.
        max_restarts_per_replica: a replica restarted this often is stopped.
        max_restarts_per_job: the job ends after this many restarts in all.
        crash_loop_restarts: restarts in a row with no committed step anywhere: crash loop.
        blame_threshold: faults on one node within ``blame_window_s`` that isolate it.
        blame_window_s: the window those faults must fall in.
        readmit_after_s: an isolated node waits this long before its self-check.
    """

    backoff_initial_s: float = 0.2
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0
    max_restarts_per_replica: int = 10
    max_restarts_per_job: int = 50
    crash_loop_restarts: int = 5
    blame_threshold: int = 2
    blame_window_s: float = 300.0
    readmit_after_s: float = 30.0

    def __post_init__(self) -> None:
        checks = {
            "backoff_initial_s": self.backoff_initial_s >= 0,
            "backoff_factor": self.backoff_factor >= 1,
            "backoff_max_s": self.backoff_max_s >= self.backoff_initial_s,
            "max_restarts_per_replica": self.max_restarts_per_replica >= 0,
            "max_restarts_per_job": self.max_restarts_per_job >= 0,
            "crash_loop_restarts": self.crash_loop_restarts >= 1,
            "blame_threshold": self.blame_threshold >= 1,
            "blame_window_s": self.blame_window_s > 0,
            "readmit_after_s": self.readmit_after_s >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid restart policy: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}")

    def backoff_s(self, failures_without_progress: int) -> float:
        """Delay before a restart, given failures in a row since the replica last committed."""
        n = max(1, failures_without_progress)
        return min(self.backoff_max_s, self.backoff_initial_s * self.backoff_factor ** (n - 1))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about a failed replica.

    Attributes:
        action: ``restart``, ``stop`` (this replica is given up) or ``end_job``.
        delay_s: backoff before the restart.
        exit_code: for ``end_job``.
        reason: the message a user reads.
    """

    action: str
    delay_s: float = 0.0
    exit_code: int = 0
    reason: str = ""


@dataclasses.dataclass
class RestartBook:
    """Counts restarts and progress; :meth:`decide` applies the policy."""

    policy: RestartPolicy
    restarts: dict[int, int] = dataclasses.field(default_factory=dict)
    failures_without_progress: dict[int, int] = dataclasses.field(default_factory=dict)
    job_restarts: int = 0
    job_restarts_since_progress: int = 0

    def progress(self, replica: int | None = None) -> None:
        """A committed step: by ``replica``, or by the job (None)."""
        self.job_restarts_since_progress = 0
        if replica is not None:
            self.failures_without_progress[replica] = 0

    def decide(self, replica: int) -> Decision:
        p = self.policy
        if self.job_restarts_since_progress >= p.crash_loop_restarts:
            return Decision(
                "end_job",
                exit_code=EXIT_CRASH_LOOP,
                reason=(
                    f"crash loop: {self.job_restarts_since_progress} restarts and no step committed since; "
                    "stopping instead of restarting forever (look at the replicas' logs for the error)"
                ),
            )
        if self.job_restarts >= p.max_restarts_per_job:
            return Decision(
                "end_job",
                exit_code=EXIT_RESTART_LIMIT,
                reason=(f"the job used its {p.max_restarts_per_job} restarts (--max-job-restarts)"),
            )
        if self.restarts.get(replica, 0) >= p.max_restarts_per_replica:
            return Decision(
                "stop", reason=(f"replica {replica} used its {p.max_restarts_per_replica} restarts (--max-restarts)")
            )
        failures = self.failures_without_progress.get(replica, 0) + 1
        return Decision(
            "restart",
            delay_s=p.backoff_s(failures),
            reason=f"restart {self.restarts.get(replica, 0) + 1}, failure {failures} in a row",
        )

    def restarted(self, replica: int) -> None:
        self.restarts[replica] = self.restarts.get(replica, 0) + 1
        self.failures_without_progress[replica] = self.failures_without_progress.get(replica, 0) + 1
        self.job_restarts += 1
        self.job_restarts_since_progress += 1


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place a replica can run: one node's share of processes."""

    node: str
    index: int
    spare: bool = False

    @property
    def name(self) -> str:
        return f"{self.node}/{self.index}"


class Placement:
    """Which replica runs on which slot, which nodes are isolated, and who is to blame.

    Args:
        slots: every slot of every node; the first ``replicas`` non-spare slots are the homes.
        policy: blame threshold, window and re-admission delay.
        min_replicas: the fewest replicas that can train. A node is not isolated when that
            would leave fewer runnable replicas: parked replicas could never train, and a
            failure that follows the job everywhere (a bug, not a node) must reach the
            crash-loop rule instead of waiting for re-admission.
    """

    def __init__(self, slots: list[Slot], replicas: int, policy: RestartPolicy, min_replicas: int = 1) -> None:
        homes = [s for s in slots if not s.spare]
        if len(homes) < replicas:
            raise ValueError(f"{replicas} replicas need {replicas} slots, only {len(homes)} are not spares")
        self.slots = list(slots)
        self.policy = policy
        self.min_replicas = min_replicas
        self.home = {r: homes[r] for r in range(replicas)}
        self.assignment: dict[int, Slot] = dict(self.home)
        self.isolated: dict[str, float] = {}  # node -> when
        self._faults: dict[str, deque[float]] = {}

    def blame(self, node: str, now: float) -> bool:
        """Records a fault on ``node``; True when it crosses the threshold and is isolated now."""
        if node in self.isolated:
            return False
        q = self._faults.setdefault(node, deque())
        q.append(now)
        while q and now - q[0] > self.policy.blame_window_s:
            q.popleft()
        if len(q) >= self.policy.blame_threshold and self._runnable_without(node) >= self.min_replicas:
            self.isolated[node] = now
            q.clear()
            return True
        return False

    def _runnable_without(self, node: str) -> int:
        """Replicas that would still have a healthy slot if ``node`` were isolated."""
        staying = sum(1 for s in self.assignment.values() if s.node != node and s.node not in self.isolated)
        displaced = sum(1 for s in self.assignment.values() if s.node == node)
        free = [s for s in self.free_slots() if s.node != node]
        return staying + min(displaced, len(free))

    def isolate(self, node: str, now: float) -> None:
        """Isolates ``node`` at once (a diagnosis verdict, not a count of faults)."""
        self.isolated.setdefault(node, now)

    def free_slots(self) -> list[Slot]:
        used = {s.name for s in self.assignment.values()}
        free = [s for s in self.slots if s.name not in used and s.node not in self.isolated]
        return sorted(free, key=lambda s: (not s.spare, s.node, s.index))  # spares first

    def place(self, replica: int) -> Slot | None:
        """Where ``replica`` (re)starts: its slot if its node is healthy, else a free one."""
        cur = self.assignment.get(replica)
        if cur is not None and cur.node not in self.isolated:
            return cur
        self.assignment.pop(replica, None)
        free = self.free_slots()
        if not free:
            return None
        self.assignment[replica] = free[0]
        return free[0]

    def remove_node(self, node: str) -> list[int]:
        """A node left (its agent died): its slots go; returns the replicas that ran there."""
        self.slots = [s for s in self.slots if s.node != node]
        lost = [r for r, s in self.assignment.items() if s.node == node]
        for r in lost:
            del self.assignment[r]
        return lost

    def add_slots(self, slots: list[Slot]) -> None:
        known = {s.name for s in self.slots}
        self.slots += [s for s in slots if s.name not in known]

    def due_for_check(self, now: float) -> list[str]:
        """Isolated nodes whose cool-down is over: run their self-check."""
        return [n for n, t in self.isolated.items() if now - t >= self.policy.readmit_after_s]

    def readmit(self, node: str, passed: bool, now: float) -> bool:
        """The self-check's result: a pass returns the node's slots to the pool."""
        if passed:
            self.isolated.pop(node, None)
            return True
        self.isolated[node] = now  # try again after another cool-down
        return False
