"""Attention with Triton kernels that read the paged KV cache through the page table in-kernel (CUDA; the Triton interpreter on CPU in tests).

Per step, `prepare` splits the sequences once into decodes (one query token) and prefill
chunks (several), as int32 index tensors into the StepBatch's per-sequence metadata:

    step rows   | d0 | p0 (chunk of 5) ......... | d1 | p1 (chunk of 3) ... |
    decode_seqs = [0, 2]   decode_rows = [0, 6]   (token row of each decode's query)
    extend_seqs = [1, 3]   rows of p_i: [cu_seqlens_q[s], cu_seqlens_q[s + 1])

Per layer, the Attention call writes the step's k, v with `KVCache.write`, takes the layer's
storage with `KVCache.kernel_view` (which waits for the layer to be ready) and launches at
most two kernels (triton_kernels.py), each writing its sequences' rows of one output tensor:
no gather of pages, no scatter of results.
"""
from __future__ import annotations

import torch

from radixserve.runner.attention.triton_kernels import paged_decode, paged_extend
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache


class TritonAttentionBackend:
    """AttentionBackend over `kv` with the paged decode and extend kernels of triton_kernels.py
    (paged attention: Kwon et al. 2023; online softmax: Milakov & Gimelshein 2018; tiling:
    FlashAttention, Dao et al. 2022). Reads any stored dtype of the cache (fp32, bf16, FP8 with
    per-(layer, KV head) scales) and computes in fp32; output in q's dtype. Tile sizes are
    chosen per launch in triton_kernels.py."""

    name = "triton"

    def __init__(self, kv: KVCache):
        self.kv = kv

    def prepare(self, step: StepBatch) -> TritonStepAttention:
        """The step's decode and prefill index tensors (see module docstring), built once."""
        # CUDA graphs for decode-only steps would capture TritonStepAttention here (not built yet).
        return TritonStepAttention(self.kv, step)


class TritonStepAttention:
    """The triton backend's metadata for one step, callable as the model's `Attention`."""

    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        device = step.input_ids.device
        decodes = [i for i, n in enumerate(step.query_lens) if n == 1]
        extends = [i for i, n in enumerate(step.query_lens) if n > 1]

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.decode_seqs = int32(decodes) if decodes else None                      # (n_d,)
        self.decode_rows = int32([step.query_starts[i] for i in decodes]) if decodes else None
        self.extend_seqs = int32(extends) if extends else None                      # (n_e,)
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
