"""The array store of link samples reads every transfer as the scalar rules do."""

from __future__ import annotations

import random

import pytest

from unbroken.diagnosis.rules import links
from unbroken.diagnosis.rules.link_samples import LinkSamples


def scalar_times(samples, offsets):
    """What the master computed before the store: one sample at a time."""
    fix = links.clock_corrections((t for xs in samples.values() for t in xs), offsets)
    out: dict = {}
    for k, xs in samples.items():
        for t in xs:
            if t.sender in offsets and t.receiver in offsets:
                x = links.transfer_time(t, offsets[t.sender], offsets[t.receiver], fix.get((t.sender, t.receiver)))
                if x is not None:
                    out.setdefault(k, []).append(x)
    return out


def random_samples(seed: int, replicas: int = 6, ranks: int = 2, per_cell: int = 20):
    rng = random.Random(seed)
    samples: dict = {}
    for a in range(replicas):
        for b in range(replicas):
            if a == b or rng.random() < 0.3:
                continue
            xs = []
            for i in range(per_cell):
                rank = rng.randrange(ranks)
                send = i * 0.1 + rng.uniform(0, 1e-3)
                recv = send + rng.uniform(-2e-3, 2e-3)
                done = max(send, recv) + rng.uniform(2e-4, 5e-3)
                queued = rng.choice([0.0, rng.uniform(0, 2e-3)])
                xs.append(links.TransferTimes((a, rank), (b, rank), send, recv, done, queued, rng.uniform(0.05, 2.0)))
            samples[(a, b)] = xs
    offsets = {(r, k): rng.uniform(-3e-3, 3e-3) for r in range(replicas) for k in range(ranks) if rng.random() < 0.9}
    return samples, offsets


@pytest.mark.parametrize("seed", range(8))
def test_the_vectorized_read_equals_the_scalar_one(seed: int) -> None:
    samples, offsets = random_samples(seed)
    window = 16
    store = LinkSamples(window)
    for k, xs in samples.items():
        for t in xs:
            store.append(k, t)
    kept = {k: xs[-window:] for k, xs in samples.items()}  # the window holds the newest
    want = scalar_times(kept, offsets)
    got = store.times(offsets)
    assert set(got) == set(want)
    for k, xs in want.items():
        assert sorted(got[k].tolist()) == pytest.approx(sorted(xs), rel=1e-9, abs=1e-12)
        for q in (0.0, 0.25, 0.75, 1.0):
            assert got.quantiles(q)[k] == pytest.approx(links.quantile_of(xs, q), rel=1e-9, abs=1e-12)
    # The rules read both alike.
    assert links.link_scores(got) == pytest.approx(links.link_scores(want))
    assert links.one_way_scores(got) == pytest.approx(links.one_way_scores(want))


def test_a_forgotten_replica_leaves_no_cell_and_its_rows_are_reused() -> None:
    store = LinkSamples(4)
    t = links.TransferTimes((0, 0), (1, 0), 0.0, 0.001, 0.002, 0.0, 1.0)
    for c in [(0, 1), (1, 0), (1, 2), (2, 1)] * 5:
        store.append(c, t)
    assert len(store) == 16  # 4 cells, each at its window
    store.forget(1)
    assert store.cells() == [] and len(store) == 0
    for i in range(100):  # a replica coming and going does not grow the store
        store.append((3, 4), links.TransferTimes((3, 0), (4, 0), 0.0, 0.001, 0.002, 0.0, 1.0))
        store.forget(4 if i % 2 else 3)
    assert len(store._count) == 8 and len(store._idents) <= 2
    assert store.times({}) == {}


def test_window_must_hold_a_transfer() -> None:
    with pytest.raises(ValueError, match="window"):
        LinkSamples(0)


def test_quantiles_read_the_newest_transfers_and_stalls_the_whole_window() -> None:
    store = LinkSamples(8, recent=4)
    for i in range(12):  # transfers 4..11 kept; 8..11 are the newest four
        for cell, (a, b) in (((0, 1), ((0, 0), (1, 0))), ((1, 0), ((1, 0), (0, 0)))):
            late = 0.010 if i in (5, 6) and cell == (0, 1) else 0.001  # two stalls, older than the newest four
            t = float(i)
            sample = links.TransferTimes(a, b, t, t + 0.0001, t + 0.0001 + late * (1 + i / 100), 0.0, 1.0)
            store.append(cell, sample, offsets={(0, 0): 0.0, (1, 0): 0.0})
    got = store.times({(0, 0): 0.0, (1, 0): 0.0})
    newest = [0.001 * (1 + i / 100) for i in range(8, 12)]
    assert sorted(got[(0, 1)].tolist()) == pytest.approx(newest)
    assert got.count_at_least(0.005) == {(0, 1): 2, (1, 0): 0}
    # A transfer whose ends' offsets were unknown when it came is not counted; a cell made again
    # in a reused row does not inherit the old cell's stalls.
    store.append((0, 2), links.TransferTimes((0, 0), (2, 0), 0.0, 0.0001, 0.5, 0.0, 1.0))
    store.forget(1)
    store.append((3, 4), links.TransferTimes((3, 0), (4, 0), 0.0, 0.0001, 0.0011, 0.0, 1.0), offsets={})
    got = store.times({(0, 0): 0.0, (2, 0): 0.0, (3, 0): 0.0, (4, 0): 0.0})
    assert got.count_at_least(0.005) == {(0, 2): 0, (3, 4): 0}
    with pytest.raises(ValueError, match="recent"):
        LinkSamples(4, recent=5)
