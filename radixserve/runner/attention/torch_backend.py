"""Attention with torch ops only (CPU or any device): one padded gather + one SDPA per layer for decodes.

Decode group, per layer (B sequences, P = max pages, S = page size, KV heads, D):

    k_store (KV, num_pages, S, D) --index_select pages--> (KV, B*P, S, D)
        -> view (KV, B, P*S, D) -> transpose -> (B, KV, P*S, D)   # each head a contiguous matrix
    SDPA(q (B, H, 1, D), k, v, mask (B, 1, 1, P*S), enable_gqa)   # GQA without expanding KV

The gather buffers are allocated once per step and reused by every layer. Prefill chunks
attend one by one: with nothing cached, causal SDPA over their own k, v; with a cached
prefix, over their gathered pages with an explicit (n, context) mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache


class TorchAttentionBackend:
    """AttentionBackend built from `torch.nn.functional.scaled_dot_product_attention`."""

    def begin_step(self, kv: KVCache, step: StepBatch) -> TorchStepAttention:
        return TorchStepAttention(kv, step)


class TorchStepAttention:
    """StepAttention for one step (see base.StepAttention)."""

    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        self.num_tokens = step.input_ids.shape[0]
        self.k_buf = self.v_buf = None
        d = step.decode
        if d is not None:
            dtype, device = kv.k_store[0].dtype, kv.k_store[0].device
            shape = (kv.num_kv_heads, d.page_table.shape[0], kv.page_size, kv.head_dim)
            self.k_buf = torch.empty(shape, dtype=dtype, device=device)
            self.v_buf = torch.empty(shape, dtype=dtype, device=device)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, step = self.kv, self.step
        kv.write(layer_id, step.slot_mapping, k, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        d = step.decode
        if d is not None and d.row_slice == (0, self.num_tokens):     # decode-only step
            return self._decode(layer_id, q).view(self.num_tokens, num_heads * head_dim)
        out = torch.empty(self.num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if d is not None:
            if d.row_slice is not None:
                out[d.row_slice[0]:d.row_slice[1]] = self._decode(layer_id, q[d.row_slice[0]:d.row_slice[1]])
            else:
                out.index_copy_(0, d.rows, self._decode(layer_id, q.index_select(0, d.rows)))
        for p in step.prefills:
            out[p.row_start:p.row_end] = self._prefill(layer_id, p, q, k, v)
        return out.view(self.num_tokens, num_heads * head_dim)

    def _decode(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D) of the decode group -> (B, H, D)."""
        d, kv = self.step.decode, self.kv
        batch = q.shape[0]
        torch.index_select(kv.k_store[layer_id], 1, d.page_table, out=self.k_buf)
        torch.index_select(kv.v_store[layer_id], 1, d.page_table, out=self.v_buf)
        ctx = d.max_pages * kv.page_size
        k = self.k_buf.view(kv.num_kv_heads, batch, ctx, kv.head_dim).transpose(0, 1)   # (B, KV, L, D)
        v = self.v_buf.view(kv.num_kv_heads, batch, ctx, kv.head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=d.mask, enable_gqa=True)
        return out.squeeze(2)                                                             # (B, H, D)

    def _prefill(self, layer_id: int, p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One chunk: q rows [row_start, row_end) -> (n, H, D)."""
        qc = q[p.row_start:p.row_end].transpose(0, 1).unsqueeze(0)                         # (1, H, n, D)
        if p.page_ids is None:
            kc = k[p.row_start:p.row_end].transpose(0, 1).unsqueeze(0)                     # (1, KV, n, D)
            vc = v[p.row_start:p.row_end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            kv = self.kv
            shape = (kv.num_kv_heads, -1, kv.head_dim)
            kc = kv.k_store[layer_id].index_select(1, p.page_ids).view(shape)[:, :p.context_len]
            vc = kv.v_store[layer_id].index_select(1, p.page_ids).view(shape)[:, :p.context_len]
            out = F.scaled_dot_product_attention(qc, kc.unsqueeze(0), vc.unsqueeze(0),
                                                 attn_mask=p.mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)                                             # (n, H, D)
