"""Attention protocols: what a layer calls with q, k, v (the runner's backends implement it) and DSA's sparse form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Attention(Protocol):
    """Bound to one step, called per layer: q (T, H, D), k, v (T, KV, D) in row order, any strides, compute dtype.
    Writes k, v at the step's slots; returns (T, H * D) contiguous in q's dtype, each row causal over its context."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence of a step: token rows [row_start, row_end), row row_start + j at position start_pos + stride * j
    (stride > 1: CP round-robin rows, runner/cp.py), context positions [0, context_len) (own rows included)."""

    row_start: int
    row_end: int
    start_pos: int
    context_len: int
    stride: int = 1


class SparseAttention(Attention, Protocol):
    """Attention with one index key per token slot (DSA's lightning indexer) and attention over chosen positions.

    `shared_selection`: the last full indexer layer's choice in this step (None before it), for IndexShare layers."""

    segments: list[Segment]
    shared_selection: list[torch.Tensor | None] | None

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        """Store keys (T, Di) at the step's slots; every token's key is written, dense steps included."""
        ...

    def index_keys(self, layer_id: int, seq: int) -> torch.Tensor:
        """Segment `seq`'s index keys, (context_len, Di) compute dtype, read after the layer's host-tier load landed."""
        ...

    def attend_selected(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                        selected: list[torch.Tensor | None]) -> torch.Tensor:
        """Latent (V = K) attention: writes k (T, 1, D) at the step's slots; segment i's rows attend only to
        positions selected[i] (n_i, K) int64 (-1: none), or to all causal positions where selected[i] is None.
        Returns (T, H * D) like Attention; scores scaled by D^-0.5."""
        ...
