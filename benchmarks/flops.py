"""The compute each side of an offline comparison must do: FLOPs of a dense Llama-family model.

A compute-bound run cannot beat (its FLOPs / the FLOP rate its kernels reach). So when two
implementations run the same workload, the ratio of their FLOPs is the speed-up one would show
over the other at equal kernel efficiency; any larger ratio needs faster kernels, not less work.

Counted (multiply-adds as 2 FLOPs, as is usual for GEMMs):
- linear layers, per computed token: 2 x (q, k, v, o, gate, up, down weights) per layer;
- the LM head, per logit row only: 2 x vocab x hidden;
- attention, per query token and layer: 4 x keys x (heads x head_dim) (q.k and p.v), keys
  counted causally (a query at position p sees p + 1 keys, masked keys of a padded batch not
  at all), so neither side is charged for work it could skip.
Norms, RoPE, SwiGLU and sampling are O(hidden) per token and left out. MoE models are out of
scope here (the count would depend on the routing).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dims:
    """What the FLOP count needs of a ModelConfig."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> Dims:
        """From a radixserve ModelConfig (dense models only; raises ValueError for MoE)."""
        if getattr(config, "moe", None) is not None:
            raise ValueError("FLOP counts cover dense models only")
        return cls(config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
                   config.num_kv_heads, config.head_dim, config.vocab_size)

    @property
    def linear_per_token(self) -> int:
        """FLOPs of one token through every layer's linear weights (no LM head)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return 2 * params * self.num_layers

    @property
    def head_per_row(self) -> int:
        return 2 * self.vocab * self.hidden

    def attention(self, first: int, last: int) -> int:
        """FLOPs of attention for query positions [first, last), each over its causal context."""
        keys = (last * (last + 1) - first * (first + 1)) // 2      # sum of (p + 1) over p
        return 4 * keys * self.num_heads * self.head_dim * self.num_layers


def serving_flops(dims: Dims, requests: list[tuple[int, int, int]]) -> int:
    """A prefix-caching engine: for each request (prompt tokens, tokens served from the cache,
    output tokens), the uncached prompt positions are computed, then every output token but the
    last is fed back as a decode step; one logit row per output token."""
    total = 0
    for prompt, cached, out in requests:
        computed = prompt - cached + max(out - 1, 0)
        total += (dims.linear_per_token * computed + dims.head_per_row * out
                  + dims.attention(cached, prompt + max(out - 1, 0)))
    return total


def padded_batch_flops(dims: Dims, batches: list[tuple[list[int], int]]) -> int:
    """Batched generate over left-padded batches: each (prompt lengths, new tokens) batch runs
    every row through the padded width W in prefill, then `new - 1` decode steps on every row;
    linear layers see the padding, attention does not (causal over each row's real tokens)."""
    total = 0
    for lens, new in batches:
        width, rows = max(lens), len(lens)
        total += dims.linear_per_token * rows * (width + new - 1) + dims.head_per_row * rows * new
        total += sum(dims.attention(0, n + new - 1) for n in lens)
    return total
