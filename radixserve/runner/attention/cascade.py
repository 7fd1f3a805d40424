"""Cascade decode attention on the DecodeMirror: a prefix several decoding sequences share is read once.

Chat behind one system prompt, few-shot prompts and agents decode many sequences whose first
pages are the same radix-cache pages. Plain decode attention reads every sequence's whole KV,
so a shared prefix is read once per sequence; on CPU that read is most of a long-context decode
step. A group (sequences whose page lists start with the same pages) attends in two parts per
layer, then merges them:

    prefix  all members' query rows against the prefix K/V [0, P), one attention with
            members * H/KV query rows per KV head              -> o_p (m, H, D), lse_p (m, H)
    suffix  every grouped sequence against its own tokens [P_i, len_i): one batched attention
            over the window [W, ctx) (W = the smallest P), masked per row -> o_s, lse_s
    merge   o = (o_p e^(lse_p - M) + o_s e^(lse_s - M)) / (e^(lse_p - M) + e^(lse_s - M)),
            M = max(lse_p, lse_s)

            key position:  0 ............ P_i ........ len_i - 1 ... ctx
            prefix part:   [=== group ===)
            suffix part:         W ....[== own ==]     (masked outside [P_i, len_i))

The merge is exact up to rounding: a softmax over a union of key sets, from each part's
log-sum-exp (Hydragen, Juravsky et al. 2024; FlashInfer's cascade attention). The prefix K/V
are read in place from one member's slot, one that holds it whole where there is one (members'
slots may borrow the prefix, decode_mirror.py; `CascadePlan.reads` tells the mirror what each
slot must hold). Sequences in no group attend over their whole context, read
in place from their slot too, as a part of their own with no suffix. `plan_cascade` returns a
plan only when the estimated KV reads (module constants) fall by at least MIN_SAVED_TOKENS;
otherwise decoding attends as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.runner.attention.torch_metadata import additive_mask

MIN_PREFIX_TOKENS = 64      # a shorter common prefix is not worth a group
MIN_SAVED_TOKENS = 1024     # KV token reads per layer a plan must save
CALL_TOKENS = 512           # an attention call's fixed cost, in token reads (~50 us on CPU)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class CascadePlan:
    """One step's parts, from `plan_cascade`. A part is a group (members sharing a prefix P) or
    a single sequence (P = its whole length, no suffix). Rows index the decode group."""

    parts: list[tuple[torch.Tensor, int, int]]   # (rows (m,) int64, first row's slot, P)
    row_slots: torch.Tensor          # (B,) int64: each decode row's mirror slot
    no_suffix: torch.Tensor          # (B, 1) bool: rows of single sequences
    num_slots: int                   # slots [0, num_slots) the suffix attention spans
    window: tuple[int, int]          # its key positions [W, ctx)
    suffix_mask: torch.Tensor        # (num_slots, 1, 1, ctx - W) additive, per slot: [P_i, len_i)
    reads: list[int]                 # per decode row, the first position read from its slot
    # Built by the step's first cascade_attend (it needs the number of heads), then reused by
    # every layer: (B * H,) int64 rows of q viewed (B * H, D) in the order the prefix
    # attentions take them (_head_order).
    head_order: torch.Tensor | None = None


def plan_cascade(slot_idx: list[int], lens: list[int], page_lists: list[list[int]], page_size: int,
                 dtype: torch.dtype, device: torch.device,
                 borrowed: list[int] | None = None) -> CascadePlan | None:
    """Group the decode group's sequences by shared leading pages; None when it saves too little.

    slot_idx / lens / page_lists: per sequence, its mirror slot, its length including the new
    token, and the page ids under it. A group's prefix P is its members' longest common page
    prefix in tokens, at most each member's length - 1 (the new token is always its own).
    `borrowed`: per sequence, the leading tokens its slot does not hold; a group's prefix is
    read from the member that borrows the least (the first of those)."""
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
            if borrowed is not None:   # the reader first
                reader = min(members, key=lambda i: borrowed[i])
                members = [reader] + [i for i in members if i != reader]
            groups.append((members, prefix))
    if not groups:
        return None
    grouped = {i for members, _ in groups for i in members}
    singles = [([i], lens[i]) for i in range(len(lens)) if i not in grouped]
    start = min(p for _, p in groups)
    ctx, num_slots = max(lens), max(slot_idx) + 1
    # KV token reads per layer: plain decode reads every slot's padded context; the plan reads
    # each part's prefix once and every slot's window, plus a fixed cost per attention call.
    plain = num_slots * ctx
    planned = (sum(p for _, p in groups + singles) + num_slots * (ctx - start)
               + CALL_TOKENS * (len(groups) + len(singles) + 1))
    if plain - planned < MIN_SAVED_TOKENS:
        return None

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    parts = groups + singles
    # Per slot, the suffix keys it sees: [P_i, len_i) for grouped rows; one key (W) elsewhere,
    # so that unused rows stay finite (their output is dropped, or weighted 0 for singles).
    lo, hi = [start] * num_slots, [start + 1] * num_slots
    for members, p in groups:
        for i in members:
            lo[slot_idx[i]], hi[slot_idx[i]] = p, lens[i]
    # What cascade_attend reads unmasked from each row's slot: a group's prefix [0, P) from its
    # first member, every other member's suffix from P. The mirror copies borrowed tokens by
    # this (decode_mirror.py); change one and the other must follow, or reads go unwritten.
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
    """q: (B, H, D), the decode group's queries; k, v: one layer's mirror (KV, slots, capacity, D),
    the new tokens already appended -> attention output (B, H, D) in q's dtype.

    The queries are reordered for every part's prefix attention by one index_select
    (`head_order`), the outputs put back in row order by one index_copy_, and the merge runs on
    whole (B, H) tensors: about 35 torch ops a layer plus 9 per part (69 with 4 groups, where
    reordering part by part took 115)."""
    batch, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    rep = num_heads // num_kv
    if plan.head_order is None:
        plan.head_order = _head_order(plan, num_heads, num_kv, q.device)
    flat = batch * num_heads
    q_parts = q.reshape(flat, head_dim).index_select(0, plan.head_order).view(1, num_kv, -1, head_dim)
    o_p, lse_p, start = [], [], 0
    for rows, slot, prefix in plan.parts:          # prefixes, read in place from one slot each
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
    # Suffixes: every slot's window in one call, queries placed by slot, as the mirror holds them.
    begin, ctx = plan.window
    n = plan.num_slots
    q_slots = torch.zeros(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    q_slots.index_copy_(0, plan.row_slots, q)
    o_s, lse_s = _flash(q_slots.view(n, num_kv, rep, head_dim), k[:, :n, begin:ctx].transpose(0, 1),
                        v[:, :n, begin:ctx].transpose(0, 1), attn_mask=plan.suffix_mask)
    o_s = o_s.reshape(n, num_heads, head_dim).index_select(0, plan.row_slots)
    lse_s = lse_s.reshape(n, num_heads).index_select(0, plan.row_slots).float()
    lse_s.masked_fill_(plan.no_suffix, float("-inf"))
    # Merge (module docstring): weights e^(lse_part - lse), lse = log(e^lse_p + e^lse_s).
    lse_prefix = lse_prefix.view(batch, num_heads)
    total = torch.logaddexp(lse_prefix, lse_s)
    w_p = torch.exp(lse_prefix - total).unsqueeze(-1)
    w_s = torch.exp(lse_s.sub_(total)).unsqueeze(-1)
    merged = torch.mul(o_prefix.view(batch, num_heads, head_dim), w_p).addcmul_(o_s, w_s)
    return merged.to(q.dtype)


def _head_order(plan: CascadePlan, num_heads: int, num_kv: int, device: torch.device) -> torch.Tensor:
    """CascadePlan.head_order: for each KV head, for each part, for each of its member rows,
    that KV head's query heads, as rows of q viewed (B * H, D). Viewed (1, KV, B * H / KV, D),
    a part's queries are one slice of the third dimension."""
    rep = num_heads // num_kv
    rows = torch.cat([rows for rows, _, _ in plan.parts])                     # part after part
    heads = torch.arange(num_heads, device=device).view(num_kv, 1, rep)       # (KV, 1, rep)
    return (rows.view(1, -1, 1) * num_heads + heads).reshape(-1)


def common_pages(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of page lists a and b, at most `limit`."""
    n = min(limit, len(a), len(b))
    for j in range(n):
        if a[j] != b[j]:
            return j
    return n
