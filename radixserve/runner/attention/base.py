"""The attention backend interface and the choice of backend per device (`--attention-backend`)."""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from radixserve.layers.attention import Attention
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)

BACKENDS = ("torch",)


class AttentionBackend(Protocol):
    """Owns the reads of one KVCache for attention. `prepare(step)` builds the step's metadata
    (masks, groups, kernel arguments) from the varlen StepBatch, once per step, and returns it
    bound as the `Attention` the model calls per layer. A backend may keep workspace across steps."""

    name: str
    kv: KVCache

    def prepare(self, step: StepBatch) -> Attention: ...


def create_backend(name: str, kv: KVCache, device: torch.device) -> AttentionBackend:
    """`name`: "auto" or one of BACKENDS. auto = torch on every device today (the torch backend's
    CPU-only fast path, DecodeMirror, is on only for CPU). Raises ValueError for unknown names."""
    from radixserve.runner.attention.torch_backend import TorchAttentionBackend

    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    mirror_bytes = 2 << 30 if device.type == "cpu" else 0
    return TorchAttentionBackend(kv, mirror_bytes=mirror_bytes)
