"""DecodeMirror: contiguous per-sequence copies of decoding sequences' KV, kept across steps.

Why: gathering every decoding sequence's pages out of the paged cache in every layer of
every step moves the whole KV twice more per step (read + write) than attention itself
reads; at 32 x 512 tokens that is ~40% of the step on CPU. The mirror keeps each decoding
sequence in a slot of a contiguous buffer per layer:

    k[layer]: (KV, num_slots, capacity, D)    slot s, token t -> k[layer][:, s, t]

and only appends the new token each step. The paged cache stays the source of truth: a
sequence is (re)copied from its pages whenever its slot is not provably current, i.e. its
length is not the expected one or the page ids under its computed tokens changed (radix
dedup, preemption). A slot that is merely behind (the sequence spent a step verifying
speculative draft tokens as a short chunk) catches up by copying only the missing tokens.
Slots of sequences that left the step are freed at once. Growing the buffer or compacting
holes re-copies all.

Shared prefixes are copied once. When a sequence's slot is filled and another decoding
sequence's slot already holds the same leading pages (a radix hit behind one system prompt),
those tokens are not copied: the slot *borrows* them and leaves [0, borrowed) unwritten. Each
step then makes every slot hold what the step reads from it before attention runs
(`_own_what_is_read`, the one rule that keeps this correct):

    slot of member i:   0 ........ borrowed ........... len_i
                        [ unwritten )[=== its own KV ===)
    cascade plan        group prefix [0, P) read from one member's slot that holds it;
                        every member's [P, len) read from its own slot
    plain attention     every slot's [0, len)
    -> a slot whose reads start below `borrowed` is copied from its pages first.

Unwritten positions are only ever read masked (weight 0), like the unused tail of a slot.
Memory is bounded by `max_bytes`; a step that does not fit returns None (gather instead).
On CPU the buffers are fresh anonymous mappings (`device.zeros`): only the pages something
writes are faulted in; torch.zeros wrote all of the capacity (0.5-2.4 s per reallocation of a
0.45-2 GB mirror on a 2-core VM, docs/benchmarks.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.runner.attention.cascade import CascadePlan, cascade_attend, common_pages, plan_cascade
from radixserve.runner.attention.torch_metadata import DecodeGroup, additive_mask
from radixserve.runner.device import zeros
from radixserve.runner.kv_cache import KVCache

_ROUND = 128  # capacity granularity in tokens


@dataclass(slots=True)
class _Slot:
    index: int
    length: int          # tokens currently mirrored (positions [0, length))
    pages: list[int]     # page ids under those tokens, as the page table said
    borrowed: int = 0    # [0, borrowed) not written here: another slot held those pages


class DecodeMirror:
    """Persistent state; `plan(kv, decode)` once per step returns the step's MirrorStep.
    `cascade`: let decode steps read prefixes that sequences share once (cascade.py)."""

    def __init__(self, max_bytes: int, cascade: bool = True):
        self.max_bytes = max_bytes
        self.cascade = cascade
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_slots = self.capacity = 0
        self.slots: dict[str, _Slot] = {}

    def reset(self) -> None:
        """Forget every slot (the buffers stay allocated)."""
        self.slots.clear()

    def retain(self, continuing: dict[str, int], decoding: frozenset[str] = frozenset()) -> None:
        """Free every slot but those of `decoding` sequences and of sequences that continue
        exactly where their slot ends: `continuing` maps the step's multi-token sequences (a
        speculative verify) to their first position. A recompute after preemption starts
        earlier, a sequence that left the step is absent: both lose their slot."""
        for rid in [r for r, slot in self.slots.items()
                    if r not in decoding and continuing.get(r) != slot.length]:
            del self.slots[rid]

    def plan(self, kv: KVCache, d: DecodeGroup, continuing: dict[str, int]) -> MirrorStep | None:
        """Bring the mirror up to date for decode group `d` (copying stale sequences' KV from
        the pages), or return None when it would exceed max_bytes. The slots of `continuing`
        sequences (see `retain`) are kept to catch up later."""
        batch, longest = len(d.request_ids), max(d.lens)
        live = frozenset(d.request_ids)
        self.retain(continuing, live)
        if not self._fits(kv, batch, longest):
            self.reset()
            return None
        stale = [i for i, rid in enumerate(d.request_ids) if not self._current(rid, d, i, kv.page_size)]
        used = [s.index for rid, s in self.slots.items() if rid not in {d.request_ids[i] for i in stale}]
        held = sum(1 for rid in self.slots if rid not in live)          # kept for verifying sequences
        grow = longest > self.capacity or batch + held > self.num_slots
        if grow or (used and max(used) >= batch + max(4, batch // 4)):
            self._allocate(kv, batch, longest, grow)    # growth or compaction: re-copy everyone
            stale = list(range(batch))
        share = self.cascade and batch > 1
        self._fill(kv, d, stale, share)
        slots = [self.slots[rid] for rid in d.request_ids]
        for i, slot in enumerate(slots):
            slot.length, slot.pages = d.lens[i], d.page_lists[i]
        slot_idx = [slot.index for slot in slots]
        cascade = (plan_cascade(slot_idx, d.lens, d.page_lists, kv.page_size, kv.compute_dtype,
                                kv.device, [slot.borrowed for slot in slots]) if share else None)
        self._own_what_is_read(kv, d, slots, cascade)
        return MirrorStep(self, kv, slot_idx, d.lens, cascade)

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _token_bytes(kv: KVCache) -> int:
        """Mirror bytes of one token slot over all layers (K and V)."""
        itemsize = torch.empty((), dtype=kv.compute_dtype).element_size()
        return 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * itemsize

    def _fits(self, kv: KVCache, batch: int, longest: int) -> bool:
        return batch * _round(longest) * self._token_bytes(kv) <= self.max_bytes

    def _current(self, rid: str, d: DecodeGroup, i: int, page_size: int) -> bool:
        slot = self.slots.get(rid)
        pos = d.lens[i] - 1                      # the new token's position
        return (slot is not None and slot.length == pos
                and d.page_lists[i][:len(slot.pages)] == slot.pages and len(slot.pages) * page_size >= pos)

    def _valid_prefix(self, rid: str, d: DecodeGroup, i: int) -> int:
        """Tokens of a stale slot that may be kept: its length when it is behind and the pages
        under it did not change, else 0 (copy everything)."""
        slot = self.slots.get(rid)
        if slot is None or slot.length >= d.lens[i] - 1 or d.page_lists[i][:len(slot.pages)] != slot.pages:
            return 0
        return slot.length

    def _allocate(self, kv: KVCache, batch: int, longest: int, grow: bool = True) -> None:
        """Free every slot; with `grow`, new buffers for `batch` sequences of up to `longest`
        tokens (compaction alone keeps the buffers). Headroom, since growth re-copies everyone:
        unwritten capacity and slots cost address space only (`zeros`), so be generous."""
        if not grow:
            self.slots.clear()
            return
        capacity = max(_round(longest + longest // 2), self.capacity)
        num_slots = max(2 * batch, self.num_slots, 8)
        while num_slots * capacity * self._token_bytes(kv) > self.max_bytes and capacity > _round(longest):
            capacity -= _ROUND
        num_slots = max(batch, min(num_slots, self.max_bytes // (capacity * self._token_bytes(kv))))
        self.slots.clear()
        if (num_slots, capacity) != (self.num_slots, self.capacity):
            shape = (kv.num_kv_heads, num_slots, capacity, kv.head_dim)
            self.k, self.v = [], []  # free the old buffers before allocating new ones
            self.k = [zeros(shape, kv.compute_dtype, kv.device) for _ in range(kv.num_layers)]
            self.v = [zeros(shape, kv.compute_dtype, kv.device) for _ in range(kv.num_layers)]
            self.num_slots, self.capacity = num_slots, capacity

    def _fill(self, kv: KVCache, d: DecodeGroup, stale: list[int], share: bool) -> None:
        """Give each stale sequence a slot and copy its computed tokens [kept, pos) from its
        pages, `kept` being what a slot that is merely behind already holds (_valid_prefix).
        With `share`, a new slot borrows the leading pages another decoding slot holds."""
        size = kv.page_size
        kept = {i: self._valid_prefix(d.request_ids[i], d, i) for i in stale}
        reused = {d.request_ids[i] for i in stale if kept[i]}
        stale_ids = {d.request_ids[i] for i in stale}
        taken = {s.index for rid, s in self.slots.items() if rid not in stale_ids or rid in reused}
        free = (i for i in range(self.num_slots) if i not in taken)
        # Slots holding their whole length, by first page: what a new slot may borrow from.
        holders: dict[int, list[tuple[list[int], int]]] = {}
        if share:
            for i, rid in enumerate(d.request_ids):
                slot = self.slots.get(rid)
                if rid not in stale_ids and slot.borrowed == 0 and slot.pages:
                    holders.setdefault(slot.pages[0], []).append((slot.pages, slot.length))
        jobs = []   # (slot, first token copied, end, pages covering them); first on a page boundary
        for i in stale:
            rid, end, pages = d.request_ids[i], d.lens[i] - 1, d.page_lists[i]
            if kept[i]:
                first = kept[i] // size * size
            else:
                borrowed = self._shareable(holders.get(pages[0], []) if pages else [], pages, end, size)
                self.slots[rid] = _Slot(next(free), 0, [], borrowed)
                first = borrowed
                if share and borrowed == 0 and pages:
                    holders.setdefault(pages[0], []).append((pages, end))
            if end > first:
                jobs.append((self.slots[rid].index, first, end, pages[first // size:-(-end // size)]))
        self._copy(kv, jobs)

    @staticmethod
    def _shareable(holders: list[tuple[list[int], int]], pages: list[int], end: int, size: int) -> int:
        """Leading tokens of a sequence with `pages` and `end` computed tokens that a holder
        (pages, tokens held) has in its slot: whole common pages, up to both lengths."""
        best = 0
        for held_pages, held_len in holders:
            common = common_pages(held_pages, pages, len(pages)) * size
            best = max(best, min(common, held_len // size * size, end // size * size))
        return best

    def _own_what_is_read(self, kv: KVCache, d: DecodeGroup, slots: list[_Slot],
                          cascade: CascadePlan | None) -> None:
        """Copy into each slot the borrowed tokens this step reads from it (module docstring):
        from `cascade.reads` (per decode row, the first position read in its slot), or from 0
        without a plan."""
        reads = cascade.reads if cascade is not None else [0] * len(slots)
        size, jobs = kv.page_size, []
        for i, (slot, first) in enumerate(zip(slots, reads)):
            if first < slot.borrowed:
                start = first // size * size
                jobs.append((slot.index, start, slot.borrowed, d.page_lists[i][start // size:slot.borrowed // size]))
                slot.borrowed = start
        self._copy(kv, jobs)

    def _copy(self, kv: KVCache, jobs: list[tuple[int, int, int, list[int]]]) -> None:
        """For each job (slot, first, end, pages), copy tokens [first, end) into the slot from
        `pages`, the pages under [first, ...) (first on a page boundary)."""
        if not jobs:
            return
        size = kv.page_size
        rows = kv.head_rows(torch.tensor([p for *_, pages in jobs for p in pages], dtype=torch.long,
                                         device=kv.device))
        counts = [len(pages) * size for *_, pages in jobs]
        for layer in range(kv.num_layers):
            for src, dst in zip(kv.gather(layer, rows), (self.k[layer], self.v[layer])):
                src = src.view(kv.num_kv_heads, -1, kv.head_dim)     # (KV, sum(counts), D)
                offset = 0
                for (slot, first, end, _), count in zip(jobs, counts):
                    dst[:, slot, first:end] = src[:, offset:offset + end - first]
                    offset += count


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


class MirrorStep:
    """One step's view of the mirror: append the new token, then attend over the slots (or by
    the step's cascade plan, when it has one)."""

    def __init__(self, mirror: DecodeMirror, kv: KVCache, slot_idx: list[int], lens: list[int],
                 cascade: CascadePlan | None = None):
        self.mirror, self.kv, self.cascade = mirror, kv, cascade
        self.num_kv, self.head_dim = kv.num_kv_heads, kv.head_dim
        batch = len(slot_idx)
        self.num_used = max(slot_idx) + 1
        self.ctx = max(lens)
        self.in_order = slot_idx == list(range(batch))
        device = kv.device
        self.slot_idx = torch.tensor(slot_idx, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        self.write_idx = self.slot_idx * mirror.capacity + lens_t - 1          # (B,) flat token index
        self.mask = None                 # a cascade plan brings its own masks
        if cascade is None:
            slot_len = torch.ones(self.num_used, dtype=torch.long, device=device)  # holes: attend to t=0
            slot_len[self.slot_idx] = lens_t
            visible = torch.arange(self.ctx, device=device)[None, :] < slot_len[:, None]
            self.mask = additive_mask(visible, kv.compute_dtype)[:, None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D), k and v: (B, KV, D) of the decode group -> (B, H, D)."""
        m = self.mirror
        k, v = self.kv.round_trip(layer, k, v)        # what the pages hold (FP8: quantised)
        flat = (self.num_kv, m.num_slots * m.capacity, self.head_dim)
        m.k[layer].view(flat).index_copy_(1, self.write_idx, k.transpose(0, 1))
        m.v[layer].view(flat).index_copy_(1, self.write_idx, v.transpose(0, 1))
        if self.cascade is not None:
            return cascade_attend(self.cascade, q, m.k[layer], m.v[layer])
        k_all = m.k[layer][:, :self.num_used, :self.ctx].transpose(0, 1)       # (S, KV, L, D)
        v_all = m.v[layer][:, :self.num_used, :self.ctx].transpose(0, 1)
        if not self.in_order:
            q = torch.zeros(self.num_used, *q.shape[1:], dtype=q.dtype, device=q.device).index_copy_(0, self.slot_idx, q)
        out = decode_attention(q, k_all, v_all, self.mask)                     # (S, H, D)
        return out if self.in_order and self.num_used == q.shape[0] else out.index_select(0, self.slot_idx)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: q (B, H, D), k and v (B, KV, L, D), additive mask
    (B, 1, 1, L) -> (B, H, D). The H / KV query heads sharing a KV head become that head's
    query rows (B, KV, H/KV, D), so each KV head is read once (GQA without expanding KV;
    a little faster on CPU than enable_gqa with one query row per head)."""
    batch, num_heads, head_dim = q.shape
    q = q.view(batch, k.shape[1], num_heads // k.shape[1], head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(batch, num_heads, head_dim)
