"""Attention with torch ops only (CPU or any device): one SDPA per layer for all decodes, over a mirror or a gather.

On the CPU with the decode kernel and a plain KV cache of its dtype, a decode step without cascade attention (one
sequence, or cascade off) reads the cache's pages in place (decode_attention_paged), with no mirror to fill. Without the
DecodeMirror decodes gather their pages per layer in cache-sized sub-batches; prefill chunks go one by one."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.decode_mirror import DecodeMirror, MirrorStep, decode_attention
from radixserve.runner.attention.torch_metadata import DecodeGroup, PrefillSeq, split_step
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache


class PagedDecode(NamedTuple):
    """A decode group read in place: page_table (B, max_pages) int64 padded with page 0, lens (B,) int64."""

    page_table: torch.Tensor
    lens: torch.Tensor


class PagedDecodeCall:
    """The per-layer call of a pure decode step read in place (every row a decode, pages read by
    decode_attention_paged): the KV write and the kernel only, all that is per step bound once. The same ops and order
    as the general path (KVCache.write's index_copy_ of K then V, kernel_view's wait, decode_attention_paged)."""

    __slots__ = ("kv", "views", "slots", "page_table", "lens", "op", "isa", "cast")

    def __init__(self, kv: KVCache, views: list[tuple[torch.Tensor, ...]], slots: torch.Tensor, paged: PagedDecode):
        self.kv, self.views, self.slots = kv, views, slots
        self.page_table, self.lens = paged
        self.op, self.isa = decode_kernel.paged_op()
        self.cast = kv.dtype if kv.dtype != kv.compute_dtype else None

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, D), k, v (B, KV, D) compute dtype -> (B, H * D)."""
        k_pages, v_pages, k_flat, v_flat = self.views[layer_id]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.cast is not None:
            k, v = k.to(self.cast), v.to(self.cast)
        k_flat.index_copy_(1, self.slots, k)
        v_flat.index_copy_(1, self.slots, v)
        self.kv.wait_ready(layer_id)
        return self.op(q, k_pages, v_pages, self.page_table, self.lens, self.isa).view(q.shape[0], -1)


class TorchAttentionBackend:
    """`mirror_bytes`: the DecodeMirror's budget (0: always gather); `decode_chunk_bytes`: gathered K + V per
    decode sub-batch (0: one sub-batch); `cascade`: mirrored decodes read shared prefixes once; `paged`: with a
    mirror, decode steps without cascade read the cache in place where decode_kernel.paged_runs (False: mirror)."""

    name = "torch"

    def __init__(self, kv: KVCache, decode_chunk_bytes: int = 4 << 20, mirror_bytes: int = 2 << 30,
                 cascade: bool = True, paged: bool = True):
        self.kv = kv
        self.decode_chunk_bytes = decode_chunk_bytes
        self.mirror = DecodeMirror(mirror_bytes, cascade) if mirror_bytes else None
        self.reads_pages = paged and self.mirror is not None and decode_kernel.paged_runs(kv)
        # per layer KVCache.plain_views, for PagedDecodeCall
        self.plain_views = [kv.plain_views(i) for i in range(kv.num_layers)] if self.reads_pages else None

    def prepare(self, step: StepBatch) -> TorchStepAttention:
        decode, prefills = split_step(step, self.kv.page_size, self.kv.compute_dtype)
        mirror_step = paged = None
        if self.mirror is not None:
            continuing = {rid: context - n for rid, n, context in
                          zip(step.request_ids, step.query_lens, step.context_lens_host) if n > 1}
            if decode is None:
                self.mirror.retain(continuing)
            elif self.reads_pages and (len(decode.lens) == 1 or not self.mirror.cascade):
                # slots kept go stale; a later mirrored step copies in only what they lack
                self.mirror.retain(continuing, frozenset(decode.request_ids))
                paged = PagedDecode(decode.page_table.view(len(decode.lens), decode.max_pages),
                                    torch.tensor(decode.lens, dtype=torch.long, device=self.kv.device))
            else:
                mirror_step = self.mirror.plan(self.kv, decode, continuing)
        attn = TorchStepAttention(self.kv, step, decode, prefills, self.decode_chunk_bytes, mirror_step, paged)
        if paged is not None and not prefills and decode.row_slice == (0, step.num_tokens) and self.plain_views:
            attn.lean = PagedDecodeCall(self.kv, self.plain_views, step.slot_mapping, paged)
        return attn


class TorchStepAttention:
    def __init__(self, kv: KVCache, step: StepBatch, decode: DecodeGroup | None,
                 prefills: list[PrefillSeq], decode_chunk_bytes: int = 0,
                 mirror_step: MirrorStep | None = None, paged: PagedDecode | None = None):
        self.kv, self.step, self.mirror_step, self.paged = kv, step, mirror_step, paged
        self.decode, self.prefills = decode, prefills
        self.num_tokens = step.num_tokens
        self.lean: PagedDecodeCall | None = None   # set by prepare for a pure decode step read in place
        d = decode
        self.chunks: list[tuple[int, int]] = [(0, d.mask.shape[0])] if d is not None else []
        self.prefill_rows = [None if p.page_ids is None else kv.head_rows(p.page_ids) for p in prefills]
        if d is not None and mirror_step is None and paged is None:
            batch = d.mask.shape[0]
            itemsize = torch.empty((), dtype=kv.compute_dtype).element_size()
            seq_bytes = (1 if kv.latent else 2) * d.max_pages * kv.page_size * kv.num_kv_heads * kv.head_dim * itemsize
            per_chunk = max(1, decode_chunk_bytes // seq_bytes) if decode_chunk_bytes else batch
            self.chunks = [(s, min(s + per_chunk, batch)) for s in range(0, batch, per_chunk)]
            rows = kv.head_rows(d.page_table).view(kv.num_kv_heads, -1)
            self.chunk_rows = [rows[:, s * d.max_pages:e * d.max_pages].reshape(-1) for s, e in self.chunks]
            numel = kv.num_kv_heads * min(per_chunk, batch) * d.max_pages * kv.page_size * kv.head_dim
            self.k_buf = torch.empty(numel, dtype=kv.compute_dtype, device=kv.device)
            self.v_buf = None if kv.latent else torch.empty(numel, dtype=kv.compute_dtype, device=kv.device)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.lean(layer_id, q, k, v)
        kv, step = self.kv, self.step
        kv.write(layer_id, step.slot_mapping, k, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        d = self.decode
        ms = self.mirror_step
        one_chunk = len(self.chunks) == 1
        if d is not None and d.row_slice == (0, self.num_tokens) and one_chunk:
            return self._attend(layer_id, q, k, v).view(self.num_tokens, -1)
        out = torch.empty(self.num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if d is not None:
            if d.row_slice is not None:
                a, b = d.row_slice
                if one_chunk:
                    out[a:b] = self._attend(layer_id, q[a:b], k[a:b], v[a:b])
                else:
                    self._decode(layer_id, q[a:b], out[a:b])
            else:
                q_d = q.index_select(0, d.rows)
                if one_chunk:
                    kv_d = (k.index_select(0, d.rows), v.index_select(0, d.rows)) if ms is not None else (k, v)
                    res = self._attend(layer_id, q_d, *kv_d)
                else:
                    res = torch.empty_like(q_d)
                    self._decode(layer_id, q_d, res)
                out.index_copy_(0, d.rows, res)
        for p, rows in zip(self.prefills, self.prefill_rows):
            out[p.row_start:p.row_end] = self._prefill(layer_id, p, rows, q, k, v)
        return out.view(self.num_tokens, num_heads * head_dim)

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The whole decode group in one call: q (B, H, D), k and v (B, KV, D) its new tokens (read by the mirror
        only) -> (B, H, D); the new tokens are already in the cache."""
        if self.paged is not None:
            view = self.kv.kernel_view(layer_id)
            return decode_kernel.decode_attention_paged(q, view.k, view.v, *self.paged)
        if self.mirror_step is not None:
            return self.mirror_step.attend(layer_id, q, k, v)
        return self._decode_chunk(layer_id, q, 0)

    def _decode(self, layer_id: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """q (B, H, D) of the decode group; writes the attention output into out (B, H, D)."""
        for i, (start, end) in enumerate(self.chunks):
            out[start:end] = self._decode_chunk(layer_id, q[start:end], i)

    def _decode_chunk(self, layer_id: int, q: torch.Tensor, chunk: int) -> torch.Tensor:
        d, kv = self.decode, self.kv
        start, end = self.chunks[chunk]
        n, num_kv, head_dim, ctx = end - start, kv.num_kv_heads, kv.head_dim, d.max_pages * kv.page_size
        shape = (num_kv * n * d.max_pages, kv.page_size * head_dim)
        k_buf = self.k_buf[:num_kv * n * ctx * head_dim].view(shape)
        v_buf = None if self.v_buf is None else self.v_buf[:k_buf.numel()].view(shape)
        k_all, v_all = kv.gather(layer_id, self.chunk_rows[chunk], k_buf, v_buf)
        k_seq = k_all.view(num_kv, n, ctx, head_dim).transpose(0, 1)
        v_seq = v_all.view(num_kv, n, ctx, head_dim).transpose(0, 1)
        return decode_attention(q, k_seq, v_seq, d.mask[start:end])

    def _prefill(self, layer_id: int, p: PrefillSeq, rows: torch.Tensor | None, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qc = q[p.row_start:p.row_end].transpose(0, 1).unsqueeze(0)
        if p.page_ids is None:
            # k, v as the cache holds them: a lossy KV dtype gives the same result however the prompt is chunked.
            kc, vc = self.kv.round_trip(layer_id, k[p.row_start:p.row_end], v[p.row_start:p.row_end])
            kc, vc = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            kv = self.kv
            shape = (kv.num_kv_heads, -1, kv.head_dim)
            kc, vc = kv.gather(layer_id, rows)
            kc, vc = kc.view(shape)[:, :p.context_len], vc.view(shape)[:, :p.context_len]
            out = F.scaled_dot_product_attention(qc, kc.unsqueeze(0), vc.unsqueeze(0),
                                                 attn_mask=p.mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
