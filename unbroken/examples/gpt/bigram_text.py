"""Training text generated on the spot, and batches addressed by (step, replica).

The corpus is drawn from a fixed random bigram language, so it is the same on every machine,
needs no download, and has a known floor on the loss. A batch is a pure function of the step
and the replica, so the data position is just the step: a replica that catches up from a peer
continues exactly where the job is.
"""

from __future__ import annotations

import bisect

import torch


def make_corpus(vocab_size: int = 48, length: int = 200_000, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Each token prefers a handful of successors: learnable structure, not noise.
    logits = torch.randn(vocab_size, vocab_size, generator=g) * 3.0
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(-1).tolist()
    draws = torch.rand(length, generator=g).tolist()
    out = [0] * length
    for i in range(1, length):
        out[i] = min(bisect.bisect_left(cdf[out[i - 1]], draws[i]), vocab_size - 1)
    return torch.tensor(out, dtype=torch.long)


def batch(
    corpus: torch.Tensor, step: int, replica: int, num_replicas: int, batch_size: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * num_replicas + replica)
    starts = torch.randint(0, corpus.numel() - block - 1, (batch_size,), generator=g)
    idx = torch.stack([corpus[s : s + block] for s in starts.tolist()])
    tgt = torch.stack([corpus[s + 1 : s + block + 1] for s in starts.tolist()])
    return idx, tgt
