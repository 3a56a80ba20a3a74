"""The pure parts of the Llama example: its schedule and its generated data (no transformers needed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from unbroken.examples.llama.markov_tokens import MarkovTokens
from unbroken.examples.llama.train import PlainBlocks, warmup_cosine


def test_warmup_then_cosine_to_the_floor() -> None:
    f = warmup_cosine(warmup=4, total=14, floor=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_a_sample_id_alone_fixes_its_tokens() -> None:
    a, b = MarkovTokens(64, 16, corpus_tokens=4096), MarkovTokens(64, 16, corpus_tokens=4096)
    assert torch.equal(a.batch([3, 7, 10**9]), b.batch([3, 7, 10**9]))
    assert a.batch([0, 1]).shape == (2, 16)
    assert not torch.equal(a.sample(0), a.sample(1))
    assert int(a.corpus.max()) < 64


def test_the_data_follows_a_sparse_chain() -> None:
    data = MarkovTokens(64, 16, corpus_tokens=1 << 14)
    c = data.corpus.reshape(256, -1)  # independent chains
    successors = {int(x): set() for x in range(64)}
    for row in c:
        for x, y in zip(row[:-1].tolist(), row[1:].tolist(), strict=False):
            successors[x].add(y)
    assert max(len(s) for s in successors.values()) <= 4  # learnable: the loss can fall towards ln(4)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        MarkovTokens(64, 1)


def test_plain_blocks_alternate_and_count_every_step(tmp_path: Path) -> None:
    """``--plain-alternate 2``: two plain steps, two of unbroken's, ...; blocks are cut by the
    steps counted here, since unbroken's own count stands still in plain blocks."""
    off = PlainBlocks(0, tmp_path, replica=0, rank=0, replicas=1)
    assert [off.next() for _ in range(5)] == [False] * 5
    assert off.label(7) == {} and not off.finished(3) and off.group is None

    blocks = PlainBlocks(2, tmp_path, replica=0, rank=0, replicas=1)  # a real Gloo group of one
    kinds, labels = [], []
    for unbroken_step in range(3):
        while blocks.next():
            kinds.append("plain")
        kinds.append("unbroken")
        labels.append(blocks.label(unbroken_step))
        assert blocks.due() == (blocks.steps % 4 < 2)
    assert kinds == ["plain", "plain", "unbroken", "unbroken", "plain", "plain", "unbroken"]
    assert labels == [
        {"step": 2, "unbroken_step": 0, "unbroken": True},
        {"step": 3, "unbroken_step": 1, "unbroken": True},
        {"step": 6, "unbroken_step": 2, "unbroken": True},
    ]
    assert blocks.finished(7) and not blocks.finished(8)
    t = torch.tensor([3.0, -1.5])
    blocks.all_reduce(t)  # the sum over one replica, averaged
    assert torch.equal(t, torch.tensor([3.0, -1.5]))
