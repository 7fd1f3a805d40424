"""The attention backend interface and the choice of backend per device (`--attention-backend`)."""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Protocol

import torch

from radixserve.layers.attention import Attention
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton") if importlib.util.find_spec("triton") is not None else ("torch",)
KNOWN_BACKENDS = ("torch", "triton")


class AttentionBackend(Protocol):
    """Owns one KVCache's attention reads; `prepare(step)` builds the step's metadata once, as the per-layer `Attention`."""

    name: str
    kv: KVCache

    def prepare(self, step: StepBatch) -> Attention: ...


def create_backend(name: str, kv: KVCache, device: torch.device,
                   batch_invariant: bool = False, cascade: bool = True, mirror: bool = True) -> AttentionBackend:
    """`name`: "auto" (triton on CUDA when installed, else torch) or one of BACKENDS; `batch_invariant` needs "auto";
    `mirror`: the torch backend may keep a DecodeMirror on CPU (False: another writer of the cache exists, DSA).
    Raises ValueError for unknown names and for triton where it cannot run (CPU needs TRITON_INTERPRET=1)."""
    if name not in ("auto", *KNOWN_BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(KNOWN_BACKENDS)}")
    if batch_invariant:
        if name != "auto":
            raise ValueError(f"--enable-deterministic-inference uses its own batch-invariant attention; "
                             f"leave --attention-backend at auto (got {name!r})")
        from radixserve.runner.attention.batch_invariant import BatchInvariantBackend

        return BatchInvariantBackend(kv)
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in BACKENDS else "torch"
    if name == "triton":
        return _triton_backend(kv, device)
    from radixserve.runner.attention.torch_backend import TorchAttentionBackend

    if device.type == "cpu":
        return TorchAttentionBackend(kv, mirror_bytes=2 << 30 if mirror else 0, cascade=cascade)
    # No mirror, one decode sub-batch: the sub-batch budget is a CPU-cache size.
    return TorchAttentionBackend(kv, decode_chunk_bytes=0, mirror_bytes=0)


def _triton_backend(kv: KVCache, device: torch.device) -> AttentionBackend:
    if "triton" not in BACKENDS:
        raise ValueError("attention backend 'triton' needs the triton package, which is not installed; "
                         "use --attention-backend torch")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention backend 'triton' runs on CUDA devices; on cpu only under the Triton "
                         "interpreter (TRITON_INTERPRET=1, for tests); use --attention-backend torch")
    try:
        from radixserve.runner.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise ValueError(f"attention backend 'triton': importing triton failed ({exc}); "
                         f"use --attention-backend torch") from exc
    logger.info("attention backend: triton (paged kernels) on %s", device)
    return TritonAttentionBackend(kv)
