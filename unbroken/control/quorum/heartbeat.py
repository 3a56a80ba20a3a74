"""How often ranks heartbeat, and when silence counts, for a job of a given size.

Every rank of every replica heartbeats to the one coordinator, which verifies each line's MAC
and parses it: tens of microseconds of its single event loop per heartbeat (measured with
``unbroken bench coordinator`` on a busy 2-core machine: up to 70). At 0.1 s per heartbeat,
5,000 ranks are 50,000 lines a second, more than a core, and the quorum answers queue behind
them. So the period grows with the job: the coordinator keeps the heartbeat rate under
``max_rate`` lines a second (2,000 by default) and tells each rank its period in the welcome.
The silence thresholds grow with it (a rank is suspect after five missed periods, evicted after
ten), so a slower heartbeat never makes a live rank look dead. The price is stated, not hidden:
at 1,000 ranks a hung (stopped) rank is evicted after 5 s instead of 2 s, at 5,000 after 25 s.
A crash is unaffected: its connection closes and the coordinator evicts it at once.

Any line from a rank counts as its heartbeat at the coordinator (a quorum request, a telemetry
batch), so a heartbeat line is sent only when nothing else went out for a period
(:func:`heartbeat_due`), and a rank that ships telemetry sends its heartbeat inside the batch:
one line a period instead of two, and none of its own for a rank that asks for a quorum at
least once a period.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class HeartbeatPlan:
    """A period and the silences that follow from it.

    Attributes:
        period_s: how often each rank heartbeats.
        suspect_after_s: silence after which forming no longer waits for a replica.
        timeout_s: silence after which a replica is evicted.
    """

    period_s: float
    suspect_after_s: float
    timeout_s: float


@functools.lru_cache(maxsize=64)  # asked on every rank's hello (100,000 at a takeover): the same few answers
def plan_heartbeats(
    ranks: int, period_s: float, suspect_after_s: float, timeout_s: float, max_rate: float
) -> HeartbeatPlan:
    """The plan for ``ranks`` heartbeating ranks: the configured one while it fits in ``max_rate``.

    Args:
        ranks: ranks the job will have (replicas times ranks per replica).
        period_s, suspect_after_s, timeout_s: the configured plan (small jobs keep it).
        max_rate: heartbeat lines a second the coordinator may spend on.
    """
    if ranks < 0 or min(period_s, suspect_after_s, timeout_s, max_rate) <= 0:
        raise ValueError(
            f"a heartbeat plan needs ranks >= 0 and positive times and rate, got {ranks}, "
            f"{period_s}, {suspect_after_s}, {timeout_s}, {max_rate}"
        )
    period = max(period_s, ranks / max_rate)
    return HeartbeatPlan(
        period_s=period,
        suspect_after_s=max(suspect_after_s, 5 * period),
        timeout_s=max(timeout_s, 10 * period),
    )


def heartbeat_due(now: float, last_sent: float, period_s: float) -> bool:
    """Whether a rank must send a heartbeat line at ``now``: only when no line of its own (a
    quorum request, a telemetry batch) went to the coordinator within the last period.

    Asked at the rank's own fixed ticks, one period apart (not a period after its last line,
    which would put every rank's heartbeat next to its next quorum request when the step is a
    multiple of the period, in the burst of requests the coordinator is answering): the longest
    a live rank is then quiet is under two periods, against the coordinator's suspicion after five.
    """
    return now - last_sent >= period_s


#: A coordinator that says nothing this long while a rank's request waits is taken for hung (a
#: live one says ``alive`` to waiting ranks while it holds its lease): with a standby, the rank
#: tries the next address. Above the lease (1 s by default), so that the standby has taken over.
COORDINATOR_SILENT_S = 1.5
#: How often a live coordinator tells waiting ranks so, at least (small jobs).
ALIVE_S = 0.25


def silent_after(timeout_s: float) -> float:
    """How long a rank told heartbeat timeout ``timeout_s`` waits on a silent coordinator: at
    least :data:`COORDINATOR_SILENT_S`, half the timeout in a large job (whose coordinator may
    be busy for longer than a small job's, answering thousands at once)."""
    return max(COORDINATOR_SILENT_S, timeout_s / 2)


def alive_every(timeout_s: float) -> float:
    """How often the coordinator says ``alive`` to ranks told heartbeat timeout ``timeout_s``:
    six times within their :func:`silent_after`, and no more often than :data:`ALIVE_S`.

    At 0.25 s whatever the size, a standby taking over from 12,500 nodes wrote an ``alive`` to
    each of their 100,000 waiting ranks four times a second while it had the most to do; their
    own threshold there is minutes.
    """
    return max(ALIVE_S, silent_after(timeout_s) / 6)
