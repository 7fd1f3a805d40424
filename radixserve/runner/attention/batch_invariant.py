"""Batch-invariant attention for `--enable-deterministic-inference`: a token's attention output depends only on its query and the KV before it.

Not on the batch, the chunking, or the prefix cache. The torch backend's output for one token
changes in the last bits with what it is computed beside: the decode group pads every sequence
to the longest, SDPA's kernels block over however many query rows a chunk has, and a chunk that
starts at a cached prefix takes a different kernel path than one from position 0. Here every
query row at position `pos` is computed by the same operations on the same shapes:

    L    = round_up(pos + 1, KEY_BLOCK)                 # a function of pos alone
    K, V = its sequence's keys/values [0, L) read from the KV cache, zero past the context
    s    = (q / sqrt(D)) @ K.T     one bmm item: the G query heads sharing a KV head (G, D) x (D, L)
    s[j] = -inf for j > pos;  p = softmax(s);  out = p @ V       another bmm item (G, L) x (L, D)

On CPU a bmm item's bits depend only on its own operands and shape, not on how many items the
call holds or where, nor on whether K was stacked or expanded (layers/batch_invariant.py
checks this at start-up), so rows may be grouped any way that is fast. Masked keys get
probability exactly 0 and are finite (zero past the context), so they add exact zeros. Keys are
always read back from the cache, the chunk's own included, so a lossy KV dtype gives the same
values whether a token was computed in this step or an earlier one.

Cost against the torch backend (docs/benchmarks.md): no SDPA kernel, keys padded to KEY_BLOCK,
a zero-padded copy of each sequence's keys per layer, and the linear layers' M = 1 fast path off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """One step's key blocks and masks, callable as the model's `Attention`.

    Decode rows (one-token sequences) with the same key length are batched into one pair of
    bmm calls; each multi-token block runs its own, per KV head, over its sequence's keys
    expanded (not copied) across the block's tokens."""

    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        self.seqs: list[_Seq] = []
        singles: dict[int, list[int]] = {}     # key length -> indices into self.seqs
        self.multi: list[int] = []              # indices of multi-token sequences
        for row, n, context, pages in zip(step.query_starts, step.query_lens, step.context_lens_host,
                                          step.page_lists):
            start, blocks = context - n, []
            pos = start
            while pos < context:
                key_len = _round_up(pos + 1, KEY_BLOCK)
                end = min(key_len, context)
                q_pos = torch.arange(pos, end, device=kv.device)[:, None]
                hidden = torch.arange(key_len, device=kv.device)[None, :] > q_pos      # (m, key_len)
                blocks.append(_Block(row + pos - start, row + end - start, key_len, hidden))
                pos = end
            page_ids = torch.tensor(pages, dtype=torch.long, device=kv.device)
            if n == 1:
                singles.setdefault(blocks[0].key_len, []).append(len(self.seqs))
            else:
                self.multi.append(len(self.seqs))
            self.seqs.append(_Seq(context, _round_up(context, KEY_BLOCK), kv.head_rows(page_ids), blocks))
        # Decode groups: (key length, member seq indices, token rows (N,), hidden (N, 1, 1, L)).
        self.decode_groups = [
            (key_len, members, torch.tensor([self.seqs[i].blocks[0].row_start for i in members],
                                            dtype=torch.long, device=kv.device),
             torch.cat([self.seqs[i].blocks[0].hidden for i in members])[:, None, None, :])
            for key_len, members in singles.items()]

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k and v (T, KV, D) of this step's tokens -> (T, H * D)."""
        kv = self.kv
        kv.write(layer_id, self.step.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = kv.num_kv_heads
        group = num_heads // num_kv
        q = (q * head_dim ** -0.5).view(num_tokens, num_kv, group, head_dim)   # elementwise: batch-free
        out = torch.empty_like(q)
        keys = {}
        for key_len, members, rows, hidden in self.decode_groups:
            kvs = [keys.setdefault(i, self._keys_values(layer_id, self.seqs[i])) for i in members]
            k_all = torch.stack([kk[:, :key_len] for kk, _ in kvs]).view(-1, key_len, head_dim)  # (N*KV, L, D)
            v_all = torch.stack([vv[:, :key_len] for _, vv in kvs]).view(-1, key_len, head_dim)
            n = rows.shape[0]
            scores = torch.bmm(q.index_select(0, rows).view(n * num_kv, group, head_dim), k_all.transpose(1, 2))
            probs = torch.softmax(scores.view(n, num_kv, group, key_len).masked_fill_(hidden, float("-inf")), -1)
            res = torch.bmm(probs.view(n * num_kv, group, key_len), v_all)               # (N*KV, G, D)
            out.index_copy_(0, rows, res.view(n, num_kv, group, head_dim))
        for i in self.multi:
            seq = self.seqs[i]
            kk, vv = keys.setdefault(i, self._keys_values(layer_id, seq))
            for block in seq.blocks:
                a, b, key_len = block.row_start, block.row_end, block.key_len
                m = b - a
                hidden = block.hidden[:, None, :]                                        # (m, 1, L)
                for h in range(num_kv):
                    scores = torch.bmm(q[a:b, h], kk[h, :key_len].t().expand(m, head_dim, key_len))
                    probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), -1)  # (m, G, L)
                    out[a:b, h] = torch.bmm(probs, vv[h, :key_len].expand(m, key_len, head_dim))
        return out.view(num_tokens, num_heads * head_dim)

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
