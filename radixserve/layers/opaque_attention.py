"""Attention as one opaque torch op (`radixserve::attention`), so a compiled decode graph calls the runner's paged
attention without tracing it; the step's real Attention is bound around each call of the graph with `bound()`."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from radixserve.layers.attention import Attention

# The per-forward context: (the step's Attention, its real token count). Set only inside `bound()`.
_BOUND: list[tuple[Attention, int]] = []


@contextlib.contextmanager
def bound(attn: Attention, num_tokens: int) -> Iterator[None]:
    """Within the block `radixserve::attention` calls `attn` on the first `num_tokens` rows (the rest are padding)."""
    _BOUND.append((attn, num_tokens))
    try:
        yield
    finally:
        _BOUND.pop()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """q (Tp, H, D), k (Tp, KV, D), v (Tp, KV, Dv) -> (Tp, H * Dv): the bound Attention over the first T rows
    (its KV writes included), zeros for the Tp - T padding rows. A fresh tensor: never an alias of an input."""
    assert _BOUND, "radixserve::attention called outside bound()"
    attn, n = _BOUND[-1]
    if n == q.shape[0]:
        out = attn(layer_id, q, k, v)
        return out.clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out
    out = attn(layer_id, q[:n], k[:n], v[:n])
    padded = out.new_zeros(q.shape[0], out.shape[1])
    padded[:n] = out
    return padded


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * v.shape[2])


# Defined with torch.library.Library rather than torch.library.custom_op: the op runs once per layer per compiled
# step, and custom_op's Python wrapper (its alias check included) costs a few microseconds more per call.
_LIB = torch.library.Library("radixserve", "FRAGMENT")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor")
_LIB.impl("attention", attention, "CompositeExplicitAutograd")
torch.library.register_fake("radixserve::attention", _attention_fake, lib=_LIB)


class OpaqueAttention:
    """The Attention a compiled graph is traced with: each layer's call becomes one `radixserve::attention` node."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.attention(q, k, v, layer_id)
