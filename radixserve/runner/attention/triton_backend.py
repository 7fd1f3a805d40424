"""Attention with Triton kernels that read the paged KV cache through the page table in-kernel (CUDA; the Triton interpreter on CPU in tests).

`prepare` splits the step once into decodes and prefill chunks; per layer at most two kernels write one output."""
from __future__ import annotations

import torch

from radixserve.runner.attention.triton_kernels import paged_decode, paged_extend
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, kv: KVCache):
        self.kv = kv

    def prepare(self, step: StepBatch) -> TritonStepAttention:
        return TritonStepAttention(self.kv, step)


class TritonStepAttention:
    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        device = step.input_ids.device
        decodes = [i for i, n in enumerate(step.query_lens) if n == 1]
        extends = [i for i, n in enumerate(step.query_lens) if n > 1]

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.decode_seqs = int32(decodes) if decodes else None
        self.decode_rows = int32([step.query_starts[i] for i in decodes]) if decodes else None
        self.extend_seqs = int32(extends) if extends else None
        self.max_extend_len = max((step.query_lens[i] for i in extends), default=0)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D), k, v: (T, KV, D) compute dtype -> (T, H * D) in q's dtype."""
        kv, step = self.kv, self.step
        kv.write(layer_id, step.slot_mapping, k, v)
        view = kv.kernel_view(layer_id)
        if q.stride(-1) != 1:
            q = q.contiguous()
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if self.decode_seqs is not None:
            paged_decode(q, view.k, view.v, view.k_scale, view.v_scale, out, step.page_table,
                         step.context_lens, self.decode_seqs, self.decode_rows)
        if self.extend_seqs is not None:
            paged_extend(q, view.k, view.v, view.k_scale, view.v_scale, out, step.page_table,
                         step.context_lens, step.cu_seqlens_q, self.extend_seqs, self.max_extend_len)
        return out.view(num_tokens, num_heads * head_dim)
