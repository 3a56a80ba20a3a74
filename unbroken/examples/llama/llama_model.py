"""A small ``transformers`` ``LlamaForCausalLM`` built from a config (no weights are downloaded).

The default is about 3.9 M parameters (4 layers, width 256, grouped-query attention with 2 KV
heads, vocabulary 2048, untied embeddings): big enough to have Llama's every part (RMSNorm,
rotary embeddings, SwiGLU, GQA), small enough to train at more than a step per second on two
CPU ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class LlamaSize:
    """The knobs of the example's Llama config."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # the optional extra is missing
        raise SystemExit("the Llama example needs transformers: pip install 'unbroken[examples]'") from e
    return transformers


def build_model(size: LlamaSize | None = None, seed: int = 0) -> torch.nn.Module:
    """The model with weights drawn from ``seed`` (every replica draws the same ones)."""
    size = LlamaSize() if size is None else size
    t = _transformers()
    config = t.LlamaConfig(
        **dataclasses.asdict(size), tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False
    )
    torch.manual_seed(seed)
    return t.LlamaForCausalLM(config)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, each its own FSDP2 unit (as torchtitan shards a Llama)."""
    layers = model.get_submodule("model.layers")
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"a Llama's model.layers is a ModuleList, got {type(layers).__name__}")
    return list(layers)
