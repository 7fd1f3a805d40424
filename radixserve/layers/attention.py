"""The one attention protocol: what a model layer calls with its q, k, v (implemented by the runner's backends)."""
from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    """Bound to one step, called per layer: q (T, H, D), k, v (T, KV, D) in row order, any strides, compute dtype.
    Writes k, v at the step's slots; returns (T, H * D) contiguous in q's dtype, each row causal over its context."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...
