"""DecodeMirror: contiguous per-sequence copies of decoding sequences' KV, kept across steps.

k[layer]: (KV, num_slots, capacity, D), slot s token t at [:, s, t]; each step appends the new token. A slot not provably
current (length or pages changed) is re-copied from the pages; a step over `max_bytes` gets None (gather instead). A slot
may borrow another slot's leading pages, leaving [0, borrowed) unwritten; `_own_what_is_read` copies in what a step
reads there (cascade.py `reads`). Unwritten positions are only ever read masked."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.cascade import CascadePlan, cascade_attend, common_pages, plan_cascade
from radixserve.runner.attention.torch_metadata import DecodeGroup, additive_mask
from radixserve.runner.device import zeros
from radixserve.runner.kv_cache import KVCache

_ROUND = 128


@dataclass(slots=True)
class _Slot:
    """Mirrors positions [0, length), whose page ids are `pages`; [0, borrowed) is not written here."""

    index: int
    length: int
    pages: list[int]
    borrowed: int = 0


class DecodeMirror:
    """Persistent state; `plan` once per step returns the step's MirrorStep. `cascade`: use cascade.py."""

    def __init__(self, max_bytes: int, cascade: bool = True):
        self.max_bytes = max_bytes
        self.cascade = cascade
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_slots = self.capacity = 0
        self.slots: dict[str, _Slot] = {}

    def reset(self) -> None:
        self.slots.clear()

    def retain(self, continuing: dict[str, int], decoding: frozenset[str] = frozenset()) -> None:
        """Keep only `decoding` slots and `continuing` ones (id -> first position) that go on where their slot ends."""
        for rid in [r for r, slot in self.slots.items()
                    if r not in decoding and continuing.get(r) != slot.length]:
            del self.slots[rid]

    def plan(self, kv: KVCache, d: DecodeGroup, continuing: dict[str, int]) -> MirrorStep | None:
        """Bring the mirror up to date for decode group `d`; None when it would exceed max_bytes."""
        batch, longest = len(d.request_ids), max(d.lens)
        live = frozenset(d.request_ids)
        self.retain(continuing, live)
        if not self._fits(kv, batch, longest):
            self.reset()
            return None
        stale = [i for i, rid in enumerate(d.request_ids) if not self._current(rid, d, i, kv.page_size)]
        used = [s.index for rid, s in self.slots.items() if rid not in {d.request_ids[i] for i in stale}]
        held = sum(1 for rid in self.slots if rid not in live)
        grow = longest > self.capacity or batch + held > self.num_slots
        if grow or (used and max(used) >= batch + max(4, batch // 4)):
            self._allocate(kv, batch, longest, grow)
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
        new_slots = None
        if kv.round_trip_by_slot:    # where each new token is stored: its page at position len - 1
            size = kv.page_size
            new_slots = torch.tensor([pages[(n - 1) // size] * size + (n - 1) % size
                                      for pages, n in zip(d.page_lists, d.lens)], dtype=torch.long, device=kv.device)
        return MirrorStep(self, kv, slot_idx, d.lens, cascade, new_slots)

    @staticmethod
    def _token_bytes(kv: KVCache) -> int:
        itemsize = torch.empty((), dtype=kv.compute_dtype).element_size()
        return (1 if kv.latent else 2) * kv.num_layers * kv.num_kv_heads * kv.head_dim * itemsize

    def _fits(self, kv: KVCache, batch: int, longest: int) -> bool:
        return batch * _round(longest) * self._token_bytes(kv) <= self.max_bytes

    def _current(self, rid: str, d: DecodeGroup, i: int, page_size: int) -> bool:
        slot = self.slots.get(rid)
        pos = d.lens[i] - 1
        return (slot is not None and slot.length == pos
                and d.page_lists[i][:len(slot.pages)] == slot.pages and len(slot.pages) * page_size >= pos)

    def _valid_prefix(self, rid: str, d: DecodeGroup, i: int) -> int:
        slot = self.slots.get(rid)
        if slot is None or slot.length >= d.lens[i] - 1 or d.page_lists[i][:len(slot.pages)] != slot.pages:
            return 0
        return slot.length

    def _allocate(self, kv: KVCache, batch: int, longest: int, grow: bool = True) -> None:
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
            self.k, self.v = [], []
            self.k = [zeros(shape, kv.compute_dtype, kv.device) for _ in range(kv.num_layers)]
            self.v = self.k if kv.latent else [zeros(shape, kv.compute_dtype, kv.device) for _ in range(kv.num_layers)]
            self.num_slots, self.capacity = num_slots, capacity

    def _fill(self, kv: KVCache, d: DecodeGroup, stale: list[int], share: bool) -> None:
        """Give each stale sequence a slot and copy its unkept tokens; with `share` a new slot borrows what it can."""
        size = kv.page_size
        kept = {i: self._valid_prefix(d.request_ids[i], d, i) for i in stale}
        reused = {d.request_ids[i] for i in stale if kept[i]}
        stale_ids = {d.request_ids[i] for i in stale}
        taken = {s.index for rid, s in self.slots.items() if rid not in stale_ids or rid in reused}
        free = (i for i in range(self.num_slots) if i not in taken)
        holders: dict[int, list[tuple[list[int], int]]] = {}
        if share:
            for i, rid in enumerate(d.request_ids):
                slot = self.slots.get(rid)
                if rid not in stale_ids and slot.borrowed == 0 and slot.pages:
                    holders.setdefault(slot.pages[0], []).append((slot.pages, slot.length))
        jobs = []
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
        best = 0
        for held_pages, held_len in holders:
            common = common_pages(held_pages, pages, len(pages)) * size
            best = max(best, min(common, held_len // size * size, end // size * size))
        return best

    def _own_what_is_read(self, kv: KVCache, d: DecodeGroup, slots: list[_Slot],
                          cascade: CascadePlan | None) -> None:
        reads = cascade.reads if cascade is not None else [0] * len(slots)
        size, jobs = kv.page_size, []
        for i, (slot, first) in enumerate(zip(slots, reads)):
            if first < slot.borrowed:
                start = first // size * size
                jobs.append((slot.index, start, slot.borrowed, d.page_lists[i][start // size:slot.borrowed // size]))
                slot.borrowed = start
        self._copy(kv, jobs)

    def _copy(self, kv: KVCache, jobs: list[tuple[int, int, int, list[int]]]) -> None:
        """Jobs (slot, first, end, pages under [first, end)), first on a page boundary: copy [first, end) into slot."""
        if not jobs:
            return
        size = kv.page_size
        rows = kv.head_rows(torch.tensor([p for *_, pages in jobs for p in pages], dtype=torch.long,
                                         device=kv.device))
        counts = [len(pages) * size for *_, pages in jobs]
        for layer in range(kv.num_layers):
            mirrors = (self.k[layer],) if kv.latent else (self.k[layer], self.v[layer])
            for src, dst in zip(kv.gather(layer, rows), mirrors):
                src = src.view(kv.num_kv_heads, -1, kv.head_dim)
                offset = 0
                for (slot, first, end, _), count in zip(jobs, counts):
                    dst[:, slot, first:end] = src[:, offset:offset + end - first]
                    offset += count


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


class MirrorStep:
    def __init__(self, mirror: DecodeMirror, kv: KVCache, slot_idx: list[int], lens: list[int],
                 cascade: CascadePlan | None = None, new_slots: torch.Tensor | None = None):
        """`new_slots`: (B,) int64 cache slots of the decode group's new tokens, for round_trip by slot."""
        self.mirror, self.kv, self.cascade, self.new_slots = mirror, kv, cascade, new_slots
        self.num_kv, self.head_dim = kv.num_kv_heads, kv.head_dim
        batch = len(slot_idx)
        self.num_used = max(slot_idx) + 1
        self.ctx = max(lens)
        self.in_order = slot_idx == list(range(batch))
        device = kv.device
        self.slot_idx = torch.tensor(slot_idx, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        self.write_idx = self.slot_idx * mirror.capacity + lens_t - 1
        self.mask = self.slot_len = None   # the kernel reads slot_len (num_used,), SDPA the additive mask
        if cascade is None:
            slot_len = torch.ones(self.num_used, dtype=torch.long, device=device)  # holes attend to t=0
            slot_len[self.slot_idx] = lens_t
            if decode_kernel.runs(kv.compute_dtype, device):
                self.slot_len = slot_len
            else:
                visible = torch.arange(self.ctx, device=device)[None, :] < slot_len[:, None]
                self.mask = additive_mask(visible, kv.compute_dtype)[:, None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D), k and v: (B, KV, D) of the decode group -> (B, H, D)."""
        m = self.mirror
        k, v = self.kv.round_trip(layer, k, v, self.new_slots)
        flat = (self.num_kv, m.num_slots * m.capacity, self.head_dim)
        m.k[layer].view(flat).index_copy_(1, self.write_idx, k.transpose(0, 1))
        if not self.kv.latent:
            m.v[layer].view(flat).index_copy_(1, self.write_idx, v.transpose(0, 1))
        if self.cascade is not None:
            return cascade_attend(self.cascade, q, m.k[layer], m.v[layer])
        k_all = m.k[layer][:, :self.num_used, :self.ctx].transpose(0, 1)
        v_all = m.v[layer][:, :self.num_used, :self.ctx].transpose(0, 1)
        if not self.in_order:
            q = torch.zeros(self.num_used, *q.shape[1:], dtype=q.dtype, device=q.device).index_copy_(0, self.slot_idx, q)
        out = (decode_attention(q, k_all, v_all, self.mask) if self.slot_len is None
               else decode_attention_lens(q, k_all, v_all, self.slot_len))
        return out if self.in_order and self.num_used == q.shape[0] else out.index_select(0, self.slot_idx)


decode_attention_lens = decode_kernel.decode_attention_lens   # a module name, so benchmarks can replace it


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, H, D), k and v (B, KV, L, D), additive mask (B, 1, 1, L) -> (B, H, D); each KV head is read once."""
    batch, num_heads, head_dim = q.shape
    q = q.view(batch, k.shape[1], num_heads // k.shape[1], head_dim)
    # reshape, not view: CUDA's SDPA may return a non-contiguous (B, KV, rep, D) tensor
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(batch, num_heads, head_dim)
