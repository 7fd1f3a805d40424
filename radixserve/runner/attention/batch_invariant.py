"""Batch-invariant attention for `--enable-deterministic-inference`: a token's attention output depends only on its query and the KV before it.

A query row at position pos runs the same ops on the same shapes whatever the batch, chunking or prefix cache:
L = round_up(pos + 1, KEY_BLOCK); K, V = its keys [0, L) read back from the cache; per KV head one bmm item (G, D) x (D, L),
keys after pos masked to -inf, softmax, one bmm item (G, L) x (L, D). On CPU a bmm item's bits depend only on its operands
and shape (layers/batch_invariant.py checks at start-up); masked keys hold finite values (the cache is zero-initialised)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.runner.batch import StepBatch
from radixserve.runner.kv_cache import KVCache

KEY_BLOCK = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(slots=True)
class _DecodeGroup:
    key_len: int
    rows: torch.Tensor
    page_rows: torch.Tensor
    hidden: torch.Tensor


@dataclass(slots=True)
class _Block:
    row_start: int
    row_end: int
    key_len: int
    hidden: torch.Tensor


@dataclass(slots=True)
class _Chunk:

    page_rows: torch.Tensor
    blocks: list[_Block]


class BatchInvariantBackend:
    name = "batch_invariant"

    def __init__(self, kv: KVCache):
        self.kv = kv

    def prepare(self, step: StepBatch) -> BatchInvariantStepAttention:
        return BatchInvariantStepAttention(self.kv, step)


class BatchInvariantStepAttention:
    def __init__(self, kv: KVCache, step: StepBatch):
        self.kv, self.step = kv, step
        device, size = kv.device, kv.page_size
        singles: dict[int, list[tuple[int, list[int], int]]] = {}
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
                                 device=device)
            page_rows = kv.head_rows(table.view(-1)).view(kv.num_kv_heads, len(members), num_pages)
            lens = torch.tensor([c for _, _, c in members], device=device)
            hidden = torch.arange(key_len, device=device)[None, :] >= lens[:, None]
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
        q = (q * head_dim ** -0.5).view(num_tokens, num_kv, group, head_dim)
        out = torch.empty_like(q)
        for g in self.decode_groups:
            n, key_len = g.rows.shape[0], g.key_len
            k_pages, v_pages = kv.gather(layer_id, g.page_rows)
            keys = k_pages.view(n * num_kv, -1, head_dim)[:, :key_len]
            values = v_pages.view(n * num_kv, -1, head_dim)[:, :key_len]
            scores = torch.bmm(q.index_select(0, g.rows).view(n * num_kv, group, head_dim), keys.transpose(1, 2))
            probs = torch.softmax(scores.view(n, num_kv, group, key_len).masked_fill_(g.hidden, float("-inf")), -1)
            res = torch.bmm(probs.view(n * num_kv, group, key_len), values)
            out.index_copy_(0, g.rows, res.view(n, num_kv, group, head_dim))
        for chunk in self.chunks:
            k_pages, v_pages = kv.gather(layer_id, chunk.page_rows)
            keys = k_pages.view(num_kv, -1, head_dim)
            values = v_pages.view(num_kv, -1, head_dim)
            for block in chunk.blocks:
                a, b, key_len = block.row_start, block.row_end, block.key_len
                m = b - a
                for h in range(num_kv):
                    scores = torch.bmm(q[a:b, h], keys[h, :key_len].t().expand(m, head_dim, key_len))
                    probs = torch.softmax(scores.masked_fill_(block.hidden, float("-inf")), -1)
                    out[a:b, h] = torch.bmm(probs, values[h, :key_len].expand(m, key_len, head_dim))
        return out.view(num_tokens, num_heads * head_dim)
