"""DSA over the paged KV cache: the index-key side buffer and SparseAttention (layers/attention.py) around any backend.

The index keys live in the KV cache's side buffer INDEX_KEYS of the full indexer layers (and an EAGLE draft's layer N),
at the token's slot, so every KV path carries them and reads wait for the layer's load (docs/mla.md, DSA)."""
from __future__ import annotations

import torch

from radixserve.layers.attention import Attention, Segment
from radixserve.runner.attention.base import AttentionBackend
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache

INDEX_KEYS = "index_k"
# FP8 index keys, per slot: index_head_dim float8_e4m3fn bytes, then the token's fp32 scale (amax / 448), 4 bytes in
# the machine's byte order (little-endian on x86 and CUDA hosts); key = fp8 value x scale.
FP8_MAX = 448.0
SCALE_BYTES = 4
# Sparse attention gathers at most this many latent values (rows x selected x D) at once.
GATHER_BLOCK_VALUES = 1 << 24


def index_bytes_per_token(full_layers: tuple[int, ...], head_dim: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """Index-key bytes per token: len(full_layers) x (index_head_dim x dtype bytes, or index_head_dim + 4 with fp8)."""
    per_layer = head_dim + SCALE_BYTES if fp8 else head_dim * torch.empty((), dtype=dtype).element_size()
    return len(full_layers) * per_layer


def add_index_keys(kv: KVCache, full_layers: tuple[int, ...], head_dim: int, dtype: torch.dtype,
                   fp8: bool = False) -> None:
    """Give `kv` its index-key side buffer in the full indexer layers: (index_head_dim,) per slot in `dtype`, or with
    `fp8` (index_head_dim + 4,) uint8 (FP8 layout above); none without full layers (a pipeline stage's)."""
    if not full_layers:
        return
    shape, dtype = ((head_dim + SCALE_BYTES,), torch.uint8) if fp8 else ((head_dim,), dtype)
    kv.add_side_buffer(INDEX_KEYS, shape, dtype, list(full_layers))


def encode_fp8(keys: torch.Tensor) -> torch.Tensor:
    """keys (T, Di) -> (T, Di + 4) uint8: e4m3(keys / scale) | scale as fp32 bytes, scale = amax / 448 per token."""
    x = keys.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / FP8_MAX                   # (T, 1)
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q, scale.view(torch.uint8)], dim=-1)


def decode_fp8(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of encode_fp8 up to the FP8 rounding: (T, Di + 4) uint8 -> (T, Di) `dtype`."""
    scale = raw[:, -SCALE_BYTES:].contiguous().view(torch.float32)                            # (T, 1)
    return (raw[:, :-SCALE_BYTES].contiguous().view(torch.float8_e4m3fn).float() * scale).to(dtype)


class SparseBackend:
    """AttentionBackend for DSA models: `inner` runs the dense steps; prepare returns a SparseStepAttention. `inner`
    must hold no copy of the cache (no DecodeMirror): sparse steps write and read the cache past it."""

    def __init__(self, inner: AttentionBackend):
        self.inner, self.kv, self.name = inner, inner.kv, inner.name

    def prepare(self, step: StepBatch) -> SparseStepAttention:
        return SparseStepAttention(self.inner.prepare(step), self.kv, step)


class SparseStepAttention:
    """SparseAttention for one step; calls (dense) go to the inner backend's Attention."""

    def __init__(self, dense: Attention, kv: KVCache, step: StepBatch):
        self.dense, self.kv, self.step = dense, kv, step
        self.segments = [Segment(row, row + n, ctx - n, ctx) for row, n, ctx in
                         zip(step.query_starts, step.query_lens, step.context_lens_host)]
        self.shared_selection: list[torch.Tensor | None] | None = None
        self._slots: dict[int, torch.Tensor] = {}

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.dense(layer_id, q, k, v)

    def context_slots(self, seq: int) -> torch.Tensor:
        """Segment `seq`'s slots of positions [0, context_len), (context_len,) int64."""
        slots = self._slots.get(seq)
        if slots is None:
            ps = self.kv.page_size
            pages = torch.tensor(self.step.page_lists[seq], dtype=torch.long, device=self.kv.device)
            slots = (pages[:, None] * ps + torch.arange(ps, device=self.kv.device)).view(-1)
            slots = self._slots[seq] = slots[:self.segments[seq].context_len]
        return slots

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        write_index_keys(self.kv, layer_id, self.step.slot_mapping, keys)

    def index_keys(self, layer_id: int, seq: int) -> torch.Tensor:
        return read_index_keys(self.kv, layer_id, self.context_slots(seq))

    def attend_selected(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                        selected: list[torch.Tensor | None]) -> torch.Tensor:
        kv = self.kv
        assert kv.latent, "sparse attention reads the latent layout (V = K)"
        kv.write(layer_id, self.step.slot_mapping, k, k)
        num_tokens, heads, dim = q.shape
        out = torch.empty(num_tokens, heads, dim, dtype=q.dtype, device=q.device)
        for i, (seg, chosen) in enumerate(zip(self.segments, selected)):
            rows = slice(seg.row_start, seg.row_end)
            positions = seg.start_pos + torch.arange(seg.row_end - seg.row_start, device=q.device)
            out[rows] = attend_chosen(kv, layer_id, q[rows], self.context_slots(i), chosen, positions)
        return out.view(num_tokens, heads * dim)


def write_index_keys(kv: KVCache, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Store keys (T, Di) compute dtype at `slots` (T,) int64 of `layer`'s index-key side buffer (FP8-encoded if so)."""
    fp8 = kv.side_export(INDEX_KEYS, 0)[1] == torch.uint8
    kv.write_side(INDEX_KEYS, layer, slots, encode_fp8(keys) if fp8 else keys)


def read_index_keys(kv: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The index keys at `slots` (n,) int64 of `layer` as (n, Di) compute dtype."""
    keys = kv.read_side(INDEX_KEYS, layer, slots)
    return decode_fp8(keys, kv.compute_dtype) if keys.dtype == torch.uint8 else keys.to(kv.compute_dtype)


def attend_chosen(kv: KVCache, layer: int, q: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor | None,
                  positions: torch.Tensor) -> torch.Tensor:
    """q (n, H, D) at `positions` (n,) int64 -> (n, H, D) q's dtype, attending (scale D^-0.5) to `layer`'s latent at
    slots[chosen] (slots (ctx,) int64 of positions [0, ctx); chosen (n, K) int64, -1 none; None: all causal)."""
    n, _, dim = q.shape
    if chosen is None:      # a short sequence in a sparse step: every causal position
        chosen = torch.arange(slots.numel(), device=q.device).expand(n, -1)
        chosen = chosen.masked_fill(chosen > positions[:, None], -1)
    out = torch.empty_like(q)
    block = max(1, GATHER_BLOCK_VALUES // (max(1, chosen.shape[1]) * dim))
    for a in range(0, n, block):
        b = min(a + block, n)
        part = chosen[a:b]
        latent = kv.read_slots(layer, slots[part.clamp(min=0).view(-1)]).view(b - a, part.shape[1], dim)  # (rows, K, D)
        scores = torch.matmul(q[a:b], latent.transpose(1, 2)).mul_(dim ** -0.5)                         # (rows, H, K)
        scores.masked_fill_((part < 0)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[a:b] = torch.matmul(probs, latent)
    return out
