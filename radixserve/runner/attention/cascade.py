"""Cascade decode attention on the DecodeMirror: a prefix several decoding sequences share is read once.

A group's queries attend to its shared prefix [0, P) read once in place from one member's slot; one masked call over
key positions [W, ctx) covers every member's own keys [P_i, len_i); the parts merge exactly by log-sum-exp (Hydragen,
Juravsky et al. 2024; FlashInfer's cascade attention). An ungrouped sequence is a part of its own with no suffix."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.runner.attention.torch_metadata import additive_mask

# In KV token reads per layer: what a plan must save, and one attention call's fixed cost.
MIN_PREFIX_TOKENS = 64
MIN_SAVED_TOKENS = 1024
CALL_TOKENS = 512
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class CascadePlan:
    """parts: (decode-group rows (m,) int64, the first row's slot, prefix P); row_slots (B,) int64; no_suffix (B, 1)
    bool; the suffix call spans slots [0, num_slots), keys window [W, ctx), suffix_mask (num_slots, 1, 1, ctx - W);
    reads[i]: first position read from row i's slot; head_order (B * H,) int64, built by the first cascade_attend."""

    parts: list[tuple[torch.Tensor, int, int]]
    row_slots: torch.Tensor
    no_suffix: torch.Tensor
    num_slots: int
    window: tuple[int, int]
    suffix_mask: torch.Tensor
    reads: list[int]
    head_order: torch.Tensor | None = None


def plan_cascade(slot_idx: list[int], lens: list[int], page_lists: list[list[int]], page_size: int,
                 dtype: torch.dtype, device: torch.device,
                 borrowed: list[int] | None = None) -> CascadePlan | None:
    """Groups (slot, len + new token, pages) by leading pages, each read at its least-`borrowed` slot; None: no gain."""
    buckets: dict[int, list[int]] = {}
    for i, pages in enumerate(page_lists):
        if pages and lens[i] - 1 >= MIN_PREFIX_TOKENS:
            buckets.setdefault(pages[0], []).append(i)
    groups: list[tuple[list[int], int]] = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        common = len(page_lists[members[0]])
        for i in members[1:]:
            common = common_pages(page_lists[members[0]], page_lists[i], common)
        prefix = min(common * page_size, min(lens[i] for i in members) - 1)
        if prefix >= MIN_PREFIX_TOKENS:
            if borrowed is not None:
                reader = min(members, key=lambda i: borrowed[i])
                members = [reader] + [i for i in members if i != reader]
            groups.append((members, prefix))
    if not groups:
        return None
    grouped = {i for members, _ in groups for i in members}
    singles = [([i], lens[i]) for i in range(len(lens)) if i not in grouped]
    start = min(p for _, p in groups)
    ctx, num_slots = max(lens), max(slot_idx) + 1
    plain = num_slots * ctx
    planned = (sum(p for _, p in groups + singles) + num_slots * (ctx - start)
               + CALL_TOKENS * (len(groups) + len(singles) + 1))
    if plain - planned < MIN_SAVED_TOKENS:
        return None

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    parts = groups + singles
    # Ungrouped slots see one key (W) so their unused rows stay finite.
    lo, hi = [start] * num_slots, [start + 1] * num_slots
    for members, p in groups:
        for i in members:
            lo[slot_idx[i]], hi[slot_idx[i]] = p, lens[i]
    # decode_mirror.py copies borrowed tokens by `reads`: change one and the other must follow.
    reads = [0] * len(lens)
    for members, p in groups:
        for i in members[1:]:
            reads[i] = p
    positions = torch.arange(start, ctx, device=device)[None, :]
    visible = (positions >= tensor(lo)[:, None]) & (positions < tensor(hi)[:, None])
    return CascadePlan(
        parts=[(tensor(members), slot_idx[members[0]], p) for members, p in parts],
        row_slots=tensor(slot_idx),
        no_suffix=torch.tensor([i not in grouped for i in range(len(lens))], device=device)[:, None],
        num_slots=num_slots, window=(start, ctx),
        suffix_mask=additive_mask(visible, dtype)[:, None, None], reads=reads)


def cascade_attend(plan: CascadePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, H, D) decode queries, k, v (KV, slots, capacity, D) a layer's mirror + new tokens -> (B, H, D), q dtype."""
    batch, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    rep = num_heads // num_kv
    if plan.head_order is None:
        plan.head_order = _head_order(plan, num_heads, num_kv, q.device)
    flat = batch * num_heads
    q_parts = q.reshape(flat, head_dim).index_select(0, plan.head_order).view(1, num_kv, -1, head_dim)
    o_p, lse_p, start = [], [], 0
    for rows, slot, prefix in plan.parts:
        end = start + rows.shape[0] * rep
        o, lse = _flash(q_parts[:, :, start:end], k[:, slot, :prefix].unsqueeze(0),
                        v[:, slot, :prefix].unsqueeze(0))
        o_p.append(o)
        lse_p.append(lse)
        start = end
    o_prefix = torch.empty(flat, head_dim, dtype=q.dtype, device=q.device)
    o_prefix.index_copy_(0, plan.head_order, torch.cat(o_p, dim=2).view(flat, head_dim))
    lse_prefix = torch.empty(flat, dtype=torch.float32, device=q.device)
    lse_prefix.index_copy_(0, plan.head_order, torch.cat(lse_p, dim=2).view(flat).float())
    begin, ctx = plan.window
    n = plan.num_slots
    q_slots = torch.zeros(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    q_slots.index_copy_(0, plan.row_slots, q)
    o_s, lse_s = _flash(q_slots.view(n, num_kv, rep, head_dim), k[:, :n, begin:ctx].transpose(0, 1),
                        v[:, :n, begin:ctx].transpose(0, 1), attn_mask=plan.suffix_mask)
    o_s = o_s.reshape(n, num_heads, head_dim).index_select(0, plan.row_slots)
    lse_s = lse_s.reshape(n, num_heads).index_select(0, plan.row_slots).float()
    lse_s.masked_fill_(plan.no_suffix, float("-inf"))
    merged, _ = merge_states(o_prefix.view(batch, num_heads, head_dim), lse_prefix.view(batch, num_heads), o_s, lse_s)
    return merged.to(q.dtype)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over key sets A and B from each part's output o (..., D) and log-sum-exp lse (...) of its scaled
    scores (natural log, fp32): lse = logaddexp(lse_a, lse_b), o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse), in fp32.

    A part with no keys (lse -inf or +inf, any o) contributes nothing: merge(empty, s) = s bit for bit and
    merge(empty, empty) = (0, -inf), never the NaN of (-inf) - (-inf) (C45)."""
    empty_a, empty_b = torch.isinf(lse_a), torch.isinf(lse_b)
    lse_a = lse_a.masked_fill(empty_a, float("-inf"))
    lse_b = lse_b.masked_fill(empty_b, float("-inf"))
    lse = torch.logaddexp(lse_a, lse_b)
    base = lse.masked_fill(empty_a & empty_b, 0.0)
    w_a = torch.exp(lse_a - base).unsqueeze(-1)
    w_b = torch.exp(lse_b - base).unsqueeze(-1)
    part_a = torch.mul(o_a, w_a).masked_fill_(empty_a.unsqueeze(-1), 0.0)
    return part_a.addcmul_(o_b.masked_fill(empty_b.unsqueeze(-1), 0.0), w_b), lse


def _head_order(plan: CascadePlan, num_heads: int, num_kv: int, device: torch.device) -> torch.Tensor:
    rep = num_heads // num_kv
    rows = torch.cat([rows for rows, _, _ in plan.parts])
    heads = torch.arange(num_heads, device=device).view(num_kv, 1, rep)
    return (rows.view(1, -1, 1) * num_heads + heads).reshape(-1)


def common_pages(a: list[int], b: list[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    for j in range(n):
        if a[j] != b[j]:
            return j
    return n
