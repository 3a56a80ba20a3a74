"""The diagnosis master over a long job: its state and its tick stay flat as epochs pass.

Every membership change opens a new collective group (``rank0/epochN``); a stalled collective
leaves a failed record and a stall on every member. The master keeps only a window of groups
per rank, so neither what it holds nor what it rescans at each 50 ms tick grows with the job.
"""

from __future__ import annotations

import time

from unbroken.diagnosis.master.master import DiagnosisMaster
from unbroken.diagnosis.telemetry import Collective, Stall, TelemetryBatch, Transfer

NS = 1_000_000_000
REPLICAS = 64


def stalled_epoch(m: DiagnosisMaster, epoch: int, t: float) -> float:
    """Two healthy collectives in a fresh group, then one every member abandons at a deadline."""
    group = f"rank0/epoch{epoch}"
    members = list(range(REPLICAS))
    for seq in range(2):
        done = t + 0.1
        for r in members:
            rec = Collective(group, seq, "allreduce", 400, int(t * NS), int(done * NS), True, members, 0, 0)
            m.ingest((r, 0), f"n{r}", TelemetryBatch(int(done * NS), records=[rec]), done)
        t = done + 0.05
    done = t + 1.0
    for r in members:
        rec = Collective(group, 2, "allreduce", 400, int(t * NS), int(done * NS), False, members, 0, 0)
        # Only half the ring's stalls reach the master: the rule cannot judge them, they stay.
        transfers = [Transfer(group, 2, "recv", (r - 1) % REPLICAS, 0, 0, int(t * NS), 0)] if r % 2 else []
        stall = Stall(group, 2, transfers, deadline_passed=r == 0)
        m.ingest((r, 0), f"n{r}", TelemetryBatch(int(done * NS), records=[rec], stalls=[stall]), done)
    return done + 0.2


def tick_s(m: DiagnosisMaster, now: float, n: int = 5) -> float:
    began = time.perf_counter()
    for i in range(n):
        m.evaluate(now + i * 0.05)
    return (time.perf_counter() - began) / n


def test_state_and_tick_stay_flat_over_200_stalled_epochs_of_64_replicas() -> None:
    m = DiagnosisMaster()
    t, sizes, ticks = 10.0, {}, {}
    for epoch in range(1, 201):
        t = stalled_epoch(m, epoch, t)
        m.evaluate(t)
        if epoch in (50, 100, 150, 200):
            sizes[epoch] = m.footprint()
            ticks[epoch] = tick_s(m, t)
    print(
        f"\nfootprint (entries) by epoch: {sizes}; tick (ms): " + str({e: round(s * 1e3, 2) for e, s in ticks.items()})
    )
    # What the master holds is the window's, not the job's: once its windows (the last 100
    # batches of each rank, the last 200 waits) are full, 150 more stalled epochs add nothing.
    assert max(sizes.values()) <= 1.01 * min(sizes.values()), sizes
    assert max(len(r.entered) for r in m.ranks.values()) <= m.s.group_window
    assert len(m.members) <= 64  # the groups some rank, stall or arrival still names, amortized
