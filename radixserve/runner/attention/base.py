"""The attention backend interface: bind one step's metadata, then attend per layer over the paged KV cache."""
from __future__ import annotations

from typing import Protocol

import torch

from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache


class StepAttention(Protocol):
    """Attention bound to one step (an `AttentionFn` for the model).

    `__call__(layer_id, q, k, v)`: q (T, H, D), k and v (T, KV, D) for the step's tokens in
    row order, any strides. Writes k, v into the cache at the step's slot mapping, then
    returns (T, H * D) contiguous: each row attends causally to its sequence's context.
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """Builds per-step attention. A backend may keep workspace buffers across steps."""

    def begin_step(self, kv: KVCache, step: StepBatch) -> StepAttention: ...
