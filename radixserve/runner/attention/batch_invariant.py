"""Batch-invariant attention for `--enable-deterministic-inference`: a token's attention output depends only on its query and the KV before it.

Not on the batch, the chunking, or the prefix cache. The torch backend's output for one token
changes in the last bits with what it is computed beside: the decode group pads every sequence
to the longest, SDPA's kernels block over however many query rows a chunk has, and a chunk that
starts at a cached prefix takes a different kernel path than one from position 0. Here every
query row at position `pos` is computed by the same operations on the same shapes:

    L    = round_up(pos + 1, KEY_BLOCK)                 # a function of pos alone
    K, V = its sequence's keys/values [0, L) read from the KV cache pages (padded with page 0)
    s    = (q / sqrt(D)) @ K.T     one bmm item: the G query heads sharing a KV head (G, D) x (D, L)
    s[j] = -inf for j > pos;  p = softmax(s);  out = p @ V       another bmm item (G, L) x (L, D)

On CPU a bmm item's bits depend only on its own operands and shape, not on how many items the
call holds or where, nor on whether K was stacked or expanded (layers/batch_invariant.py
checks this at start-up), so rows may be grouped any way that is fast. Masked keys get
probability exactly 0 and hold finite values (the cache is zero-initialised and only ever
written with model outputs), so p * v adds exact zeros whatever they hold. Keys are
always read back from the cache, the chunk's own included, so a lossy KV dtype gives the same
values whether a token was computed in this step or an earlier one.

Cost against the torch backend (docs/benchmarks.md): no SDPA kernel or DecodeMirror, keys
padded to KEY_BLOCK, and the linear layers' M = 1 fast path off.
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
class _DecodeGroup:
    """One-token sequences whose key length is `key_len`: token `rows` (N,), gather rows of their
    pages in (sequence, KV head, page) order (N * KV * P,), `hidden` (N, 1, 1, key_len)."""

    key_len: int
    rows: torch.Tensor
    page_rows: torch.Tensor
    hidden: torch.Tensor


@dataclass(slots=True)
class _Block:
    """Query rows [row_start, row_end) of a multi-token sequence whose positions share a key
    block; `hidden`: (rows, 1, key_len) bool, True for keys after the row's position."""

    row_start: int
    row_end: int
    key_len: int
    hidden: torch.Tensor


@dataclass(slots=True)
class _Chunk:
    """A multi-token sequence: the gather rows of its pages (KV * P,), head-major, and its blocks."""

    page_rows: torch.Tensor
    blocks: list[_Block]


class BatchInvariantBackend:
    """AttentionBackend for deterministic inference on the CPU (see module docstring)."""

    name = "batch_invariant"

    def __init__(self, kv: KVCache):
        self.kv = kv

    def prepare(self, step: StepBatch) -> BatchInvariantStepAttention:
        return BatchInvariantStepAttention(self.kv, step)


class BatchInvariantStepAttention:
    """One step's decode groups and prefill blocks, callable as the model's `Attention`.

    Decode rows (one-token sequences) with the same key length share one gather and one pair of
    bmm calls; each multi-token block runs its own, per KV head, over its sequence's keys
    expanded (not copied) across the block's tokens."""

    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        device, size = kv.device, kv.page_size
        singles: dict[int, list[tuple[int, list[int], int]]] = {}   # key length -> (row, pages, context)
        self.chunks: list[_Chunk] = []
        for row, n, context, pages in zip(step.query_starts, step.query_lens, step.context_lens_host,
                                          step.page_lists):
            if n == 1:
                singles.setdefault(_round_up(context, KEY_BLOCK), []).append((row, pages, context))
                continue
            blocks, start = [], context - n
            pos = start
            while pos < context:
                key_len = _round_up(pos + 1, KEY_BLOCK)
                end = min(key_len, context)
                hidden = torch.arange(key_len, device=device)[None, :] > torch.arange(pos, end, device=device)[:, None]
                blocks.append(_Block(row + pos - start, row + end - start, key_len, hidden[:, None, :]))
                pos = end
            padded = pages + [0] * (-(-blocks[-1].key_len // size) - len(pages))
            self.chunks.append(_Chunk(kv.head_rows(torch.tensor(padded, dtype=torch.long, device=device)), blocks))
        self.decode_groups = []
        for key_len, members in singles.items():
            num_pages = -(-key_len // size)
            table = torch.tensor([p + [0] * (num_pages - len(p)) for _, p, _ in members], dtype=torch.long,
                                 device=device)                                              # (N, P)
            page_rows = kv.head_rows(table.view(-1)).view(kv.num_kv_heads, len(members), num_pages)
            lens = torch.tensor([c for _, _, c in members], device=device)
            hidden = torch.arange(key_len, device=device)[None, :] >= lens[:, None]          # (N, L)
            self.decode_groups.append(_DecodeGroup(
                key_len, torch.tensor([r for r, _, _ in members], dtype=torch.long, device=device),
                page_rows.transpose(0, 1).reshape(-1), hidden[:, None, None, :]))

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k and v (T, KV, D) of this step's tokens -> (T, H * D)."""
        kv = self.kv
        kv.write(layer_id, self.step.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = kv.num_kv_heads
        group = num_heads // num_kv
        q = (q * head_dim ** -0.5).view(num_tokens, num_kv, group, head_dim)   # elementwise: batch-free
        out = torch.empty_like(q)
        for g in self.decode_groups:
            n, key_len = g.rows.shape[0], g.key_len
            k_pages, v_pages = kv.gather(layer_id, g.page_rows)                 # (N * KV * P, S * D)
            keys = k_pages.view(n * num_kv, -1, head_dim)[:, :key_len]           # (N * KV, L, D)
            values = v_pages.view(n * num_kv, -1, head_dim)[:, :key_len]
            scores = torch.bmm(q.index_select(0, g.rows).view(n * num_kv, group, head_dim), keys.transpose(1, 2))
            probs = torch.softmax(scores.view(n, num_kv, group, key_len).masked_fill_(g.hidden, float("-inf")), -1)
            res = torch.bmm(probs.view(n * num_kv, group, key_len), values)       # (N * KV, G, D)
            out.index_copy_(0, g.rows, res.view(n, num_kv, group, head_dim))
        for chunk in self.chunks:
            k_pages, v_pages = kv.gather(layer_id, chunk.page_rows)
            keys = k_pages.view(num_kv, -1, head_dim)                             # (KV, P * S, D)
            values = v_pages.view(num_kv, -1, head_dim)
            for block in chunk.blocks:
                a, b, key_len = block.row_start, block.row_end, block.key_len
                m = b - a
                for h in range(num_kv):
                    scores = torch.bmm(q[a:b, h], keys[h, :key_len].t().expand(m, head_dim, key_len))
                    probs = torch.softmax(scores.masked_fill_(block.hidden, float("-inf")), -1)  # (m, G, L)
                    out[a:b, h] = torch.bmm(probs, values[h, :key_len].expand(m, key_len, head_dim))
        return out.view(num_tokens, num_heads * head_dim)
