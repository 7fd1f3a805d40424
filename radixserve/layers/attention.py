"""The one attention protocol: what a model layer calls with its q, k, v (implemented by the runner's backends)."""
from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    """Attention bound to one step, called once per layer by the model.

    `__call__(layer_id, q, k, v)`: q (T, H, D), k and v (T, KV, D) for the step's tokens in
    row order, any strides, compute dtype. Writes k, v into the KV cache at the step's slot
    mapping, then returns (T, H * D) contiguous in q's dtype: each row attends causally to
    its sequence's context (cached prefix plus the step's own tokens).
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...
