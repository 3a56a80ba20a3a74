"""Generated token data: sample ``i`` is a fixed window of a corpus drawn from a sparse Markov chain.

Each token is followed by one of 4 successors (fixed per token), so a model can learn the
chain: the loss starts near ln(vocab) and falls towards ln(4). The corpus is drawn once from a
seed, in a fraction of a second, so nothing is shipped or downloaded; a sample id alone
determines its tokens, which is what lets :mod:`unbroken.train.data` account for every sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUCCESSORS = 4


class MarkovTokens:
    """Token sequences of length ``seq_len`` by sample id (a causal LM shifts its labels itself)."""

    def __init__(self, vocab_size: int, seq_len: int, corpus_tokens: int = 1 << 18, seed: int = 1234) -> None:
        if seq_len < 2 or corpus_tokens <= seq_len * 2:
            raise ValueError(
                f"need 2 <= seq_len <= corpus_tokens / 2, got seq_len={seq_len}, corpus_tokens={corpus_tokens}"
            )
        self.seq_len = seq_len
        g = torch.Generator().manual_seed(seed)
        succ = torch.randint(vocab_size, (vocab_size, SUCCESSORS), generator=g)
        chains = 256
        length = corpus_tokens // chains
        cur = torch.randint(vocab_size, (chains,), generator=g)
        picks = torch.randint(SUCCESSORS, (length, chains), generator=g)
        cols = []
        for t in range(length):  # vectorized over the chains
            cols.append(cur)
            cur = succ[cur, picks[t]]
        self.corpus = torch.stack(cols, dim=1).reshape(-1)

    def sample(self, i: int) -> torch.Tensor:
        """The ``seq_len`` tokens of sample ``i`` (any non-negative id)."""
        span = self.corpus.numel() - self.seq_len
        start = (i * 2654435761) % span  # Knuth's multiplicative hash: neighbouring ids far apart
        return self.corpus[start : start + self.seq_len]

    def batch(self, ids: Sequence[int]) -> torch.Tensor:
        """``[len(ids), seq_len]`` tokens: ``model(input_ids=b, labels=b)``."""
        return torch.stack([self.sample(i) for i in ids])
