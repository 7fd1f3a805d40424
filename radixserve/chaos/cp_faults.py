"""Fault point of LayerSplit (runner/layer_split.py LayerSplit.fault): drop the wait for a layer's KV broadcast."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerSplitFaults:
    """`drop_kv_wait`: attention reads a non-owned layer's scratch before the owner's broadcast has landed (it lands
    after the forward), GLM's read-before-ready bug class; the pages it would have filled then hold `stale_value` (None:
    whatever an earlier layer or step left, possibly right). Tests only, not in /admin/fault."""

    drop_kv_wait: bool = False
    stale_value: float | None = float("nan")
