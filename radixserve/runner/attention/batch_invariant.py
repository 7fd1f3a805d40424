"""Batch-invariant attention for `--enable-deterministic-inference`: a token's attention output depends only on its query and the KV before it.

Not on the batch, the chunking, or the prefix cache. The torch backend's output for one token
changes in the last bits with what it is computed beside: the decode group pads every sequence
to the longest, SDPA's kernels block over however many query rows a chunk has, and a chunk that
starts at a cached prefix takes a different kernel path than one from position 0. Here every
query row at position `pos` is computed by the same sequence of operations on the same shapes:

    L    = round_up(pos + 1, KEY_BLOCK)                 # a function of pos alone
    K, V = the sequence's keys/values [0, L) read from the KV cache, zero past its context
    s    = (q / sqrt(D)) @ K.T          batch-invariant matmul (layers/batch_invariant.py)
    s[j] = -inf for j > pos;  p = softmax(s);  out = p @ V   (again batch-invariant)

Query rows (token, query head of a KV head's group) whose positions share a KEY_BLOCK go through
one pair of matmuls; a row's bits do not depend on how many rows share them. Masked keys get
probability exactly 0 and finite values, so they add exact zeros. Keys are always read back
from the cache, also for the chunk's own tokens, so a lossy KV dtype gives the same values
whether a token was computed in this step or an earlier one.

Cost: one K and one V pack per (sequence, KV head, key block) per layer, and no decode grouping;
docs/benchmarks.md states the measured cost against the torch backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.batch_invariant import matmul, pack
from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache

KEY_BLOCK = 64   # keys per block: a row at position pos attends over round_up(pos + 1, KEY_BLOCK) keys


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(slots=True)
class _Block:
    """Query rows [row_start, row_end) of one sequence whose positions share a key block;
    `hidden`: (rows, key_len) bool, True for keys after the row's position."""

    row_start: int
    row_end: int
    key_len: int
    hidden: torch.Tensor


@dataclass(slots=True)
class _Seq:
    context_len: int
    key_len: int              # keys read: round_up(context_len, KEY_BLOCK)
    page_rows: torch.Tensor   # KVCache.head_rows of the pages covering [0, context_len)
    blocks: list[_Block]


class BatchInvariantBackend:
    """AttentionBackend for deterministic inference on the CPU (see module docstring)."""

    name = "batch_invariant"

    def __init__(self, kv: KVCache):
        self.kv = kv

    def prepare(self, step: StepBatch) -> BatchInvariantStepAttention:
        return BatchInvariantStepAttention(self.kv, step)


class BatchInvariantStepAttention:
    """One step's per-sequence key blocks and masks, callable as the model's `Attention`."""

    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        self.seqs: list[_Seq] = []
        for row, n, context, pages in zip(step.query_starts, step.query_lens, step.context_lens_host,
                                          step.page_lists):
            start, blocks = context - n, []
            pos = start
            while pos < context:
                key_len = _round_up(pos + 1, KEY_BLOCK)
                end = min(key_len, context)
                q_pos = torch.arange(pos, end)[:, None]
                blocks.append(_Block(row + pos - start, row + end - start, key_len,
                                     torch.arange(key_len)[None, :] > q_pos))
                pos = end
            page_ids = torch.tensor(pages, dtype=torch.long, device=kv.device)
            self.seqs.append(_Seq(context, _round_up(context, KEY_BLOCK), kv.head_rows(page_ids), blocks))
        self._group_masks: dict[int, list[list[torch.Tensor]]] = {}

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k and v (T, KV, D) of this step's tokens -> (T, H * D)."""
        kv = self.kv
        kv.write(layer_id, self.step.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // kv.num_kv_heads
        masks = self._masks(group)
        q = q * head_dim ** -0.5                                # elementwise: the same bits in any batch
        out = torch.empty_like(q)
        for seq, seq_masks in zip(self.seqs, masks):
            keys, values = self._keys_values(layer_id, seq)      # (KV, key_len, D) each
            for h in range(kv.num_kv_heads):
                heads = slice(h * group, (h + 1) * group)
                for block, hidden in zip(seq.blocks, seq_masks):
                    a, b, n = block.row_start, block.row_end, block.key_len
                    rows = q[a:b, heads].reshape(-1, head_dim)                  # (m * G, D)
                    scores = matmul(rows, pack(keys[h, :n]))               # (m * G, n)
                    probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
                    res = matmul(probs, pack(values[h, :n].t()))         # (m * G, D)
                    out[a:b, heads] = res.view(b - a, group, head_dim)
        return out.view(num_tokens, num_heads * head_dim)

    def _masks(self, group: int) -> list[list[torch.Tensor]]:
        """Each block's `hidden` repeated per query head of a group: rows ordered (token, head)."""
        if group not in self._group_masks:
            self._group_masks[group] = [[blk.hidden.repeat_interleave(group, dim=0) for blk in seq.blocks]
                                        for seq in self.seqs]
        return self._group_masks[group]

    def _keys_values(self, layer_id: int, seq: _Seq) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's K and V (KV, key_len, D) in compute dtype, zero from context_len on."""
        kv = self.kv
        shape = (kv.num_kv_heads, -1, kv.head_dim)
        k_pages, v_pages = kv.gather(layer_id, seq.page_rows)
        out = []
        for pages in (k_pages, v_pages):
            full = torch.zeros(kv.num_kv_heads, seq.key_len, kv.head_dim, dtype=kv.compute_dtype,
                               device=kv.device)
            full[:, :seq.context_len] = pages.view(shape)[:, :seq.context_len]
            out.append(full)
        return out[0], out[1]
