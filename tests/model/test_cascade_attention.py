"""Cascade decode attention (runner/attention/cascade.py): shared prefixes read once, merged by log-sum-exp.

The merge against plain attention on random K/V (groups with different prefixes, sequences in
no group, out-of-order slots, fp32 and bf16); the planner's grouping and its cost rule; and
the runner end to end: requests behind shared prefix pages decode together with the plan in use,
every token checked against transformers, and with FP8 KV against the page-gather path.
"""
from __future__ import annotations

import math

import pytest
import torch

import radixserve.runner.attention.cascade as cascade
from radixserve.runner.attention.cascade import cascade_attend, plan_cascade
from tests.model.test_runner import Harness, Seq

KV, REP, D = 2, 3, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int],
              lens: list[int]) -> torch.Tensor:
    """Plain attention per sequence over its slot's [0, len): q (B, H, D) -> (B, H, D), fp64."""
    out = []
    for i, (slot, n) in enumerate(zip(slots, lens)):
        keys = k[:, slot, :n].double().repeat_interleave(REP, 0)      # (H, n, D)
        vals = v[:, slot, :n].double().repeat_interleave(REP, 0)
        scores = torch.einsum("hd,hnd->hn", q[i].double(), keys) / math.sqrt(D)
        out.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), vals))
    return torch.stack(out)


def mirror_with_groups(lens: list[int], groups: list[tuple[list[int], int]], slots: list[int], page: int):
    """Random mirror K/V (KV, slots, capacity, D) whose grouped sequences hold the same prefix,
    and page lists sharing their first prefix // page pages."""
    g = torch.Generator().manual_seed(0)
    num_slots, capacity = max(slots) + 2, max(lens) + 8
    k = torch.randn(KV, num_slots, capacity, D, generator=g)
    v = torch.randn(KV, num_slots, capacity, D, generator=g)
    next_page = 1000
    pages = []
    for n in lens:
        pages.append(list(range(next_page, next_page + -(-n // page))))
        next_page += len(pages[-1])
    for members, prefix in groups:
        lead = members[0]
        for i in members[1:]:
            k[:, slots[i], :prefix] = k[:, slots[lead], :prefix]
            v[:, slots[i], :prefix] = v[:, slots[lead], :prefix]
            pages[i][:prefix // page] = pages[lead][:prefix // page]
    return k, v, pages


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_equals_plain_attention(monkeypatch, dtype, tol):
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)     # plan whatever it costs
    lens = [150, 97, 160, 133, 40, 150, 88]
    slots = [3, 0, 5, 1, 6, 2, 4]                 # not in batch order
    groups = [([0, 2, 5], 128), ([1, 3], 80)]     # 4 and 6 are in no group
    k, v, pages = mirror_with_groups(lens, groups, slots, page=16)
    q = torch.randn(len(lens), KV * REP, D, generator=torch.Generator().manual_seed(1))
    plan = plan_cascade(slots, lens, pages, 16, dtype, torch.device("cpu"))
    assert plan is not None
    assert sorted((sorted(r.tolist()), p) for r, _, p in plan.parts) == [
        ([0, 2, 5], 128), ([1, 3], 80), ([4], 40), ([6], 88)]        # singles: their whole length
    got = cascade_attend(plan, q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype and got.shape == q.shape
    ref = reference(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), slots, lens)
    assert torch.allclose(got.double(), ref, atol=tol, rtol=0)


def test_planner_caps_the_prefix_and_keeps_what_does_not_pay(monkeypatch):
    page = 16
    # Two sequences whose pages are all shared but the last: the prefix stops before the new token.
    lens = [129, 129]
    pages = [list(range(9)), list(range(8)) + [99]]
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)
    plan = plan_cascade([0, 1], lens, pages, page, torch.float32, torch.device("cpu"))
    assert [p for *_, p in plan.parts] == [128]
    # Same pages on a 129-token and a 100-token sequence: P <= the shorter one's length - 1.
    plan = plan_cascade([0, 1], [129, 100], [list(range(9)), list(range(7))], page, torch.float32,
                        torch.device("cpu"))
    assert [p for *_, p in plan.parts] == [99]
    # No shared first page, or a prefix under MIN_PREFIX_TOKENS: no plan.
    assert plan_cascade([0, 1], lens, [list(range(9)), list(range(10, 19))], page, torch.float32,
                        torch.device("cpu")) is None
    assert plan_cascade([0, 1], lens, [list(range(9)), [0, 1, 2] + list(range(20, 26))], page,
                        torch.float32, torch.device("cpu")) is None
    # The default cost rule: sharing 128 tokens between two saves less than the calls cost.
    monkeypatch.undo()
    assert plan_cascade([0, 1], lens, pages, page, torch.float32, torch.device("cpu")) is None


def shared(h: Harness, lead: Seq, rid: str, num_pages: int, own_len: int) -> Seq:
    """A request behind `lead`'s first `num_pages` pages (a radix hit): their KV is not recomputed."""
    prefix = lead.prompt[:num_pages * h.page_size]
    seq = h.new_seq(rid, own_len)
    seq.prompt = prefix + seq.prompt
    seq.pages = lead.pages[:num_pages] + seq.pages[:len(seq.pages) - num_pages]
    seq.computed = len(prefix)
    return seq


def test_runner_decodes_shared_prefixes_through_the_cascade_like_transformers(gqa_dir, monkeypatch):
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 8)
    calls = []
    monkeypatch.setattr("radixserve.runner.attention.decode_mirror.cascade_attend",
                        lambda *a: calls.append(1) or cascade_attend(*a))
    h = Harness(gqa_dir, page_size=8, seed=5)
    a, x = h.new_seq("a", 70), h.new_seq("x", 30)            # x shares nothing
    h.step([(a, a.chunk()), (x, x.chunk())])
    b, c = shared(h, a, "b", 6, 5), shared(h, a, "c", 4, 9)  # 48- and 32-token shared prefixes
    h.step([(b, b.chunk()), (c, c.chunk()), (a, a.chunk()), (x, x.chunk())])
    for _ in range(6):
        h.step([(s, s.chunk()) for s in (c, a, x, b)])
    assert calls, "the cascade plan was never used"
    assert [len(s.output) for s in (a, x, b, c)] == [8, 8, 7, 7]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_cascade_agrees_with_the_page_gather_path(gqa_dir, monkeypatch, kv_dtype):
    """FP8 KV included: the mirror holds what the pages return (round_trip), so the prefix read
    from one member's slot is what every member's pages hold; tokens and logprobs as gathering."""
    from radixserve.runner.attention.torch_backend import TorchAttentionBackend
    from tests.model.test_decode_mirror import run_both

    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 8)
    calls = []
    monkeypatch.setattr("radixserve.runner.attention.decode_mirror.cascade_attend",
                        lambda *args: calls.append(1) or cascade_attend(*args))
    h = Harness(gqa_dir, page_size=8, seed=7, kv_cache_dtype=kv_dtype)
    with_cascade = TorchAttentionBackend(h.runner.kv)
    gather = TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    a, x = h.new_seq("a", 60), h.new_seq("x", 20)
    run_both(h, with_cascade, gather, [(a, a.chunk()), (x, x.chunk())])
    b, c = shared(h, a, "b", 7, 3), shared(h, a, "c", 5, 6)
    run_both(h, with_cascade, gather, [(s, s.chunk()) for s in (b, c, a, x)])
    for _ in range(5):
        run_both(h, with_cascade, gather, [(s, s.chunk()) for s in (x, c, b, a)])
    assert [len(s.output) for s in (a, x, b, c)] == [7, 7, 6, 6]
    assert calls, "the cascade plan was never used"


def test_a_shared_prefix_is_copied_once_and_copied_again_before_any_slot_reads_it(gqa_dir, monkeypatch):
    """Slots behind another decoding slot's pages borrow them (left unwritten); each step must
    copy into a slot what that step reads from it: after the slot that held the prefix leaves,
    and when the plan is declined (plain attention reads every slot whole)."""
    from radixserve.runner.attention.torch_backend import TorchAttentionBackend
    from tests.model.test_decode_mirror import run_both

    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 8)
    h = Harness(gqa_dir, page_size=8, seed=11)
    backend, gather = TorchAttentionBackend(h.runner.kv), TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    mirror = backend.mirror
    a, x = h.new_seq("a", 60), h.new_seq("x", 20)
    run_both(h, backend, gather, [(a, a.chunk()), (x, x.chunk())])
    b, c = shared(h, a, "b", 7, 3), shared(h, a, "c", 5, 6)
    run_both(h, backend, gather, [(s, s.chunk()) for s in (b, c, a, x)])
    run_both(h, backend, gather, [(s, s.chunk()) for s in (x, c, b, a)])
    borrowed = {r: mirror.slots[r].borrowed for r in "abcx"}
    # The group {a, b, c} shares 5 pages (40 tokens): b's pages 6-7 are read as its suffix.
    assert borrowed == {"a": 0, "x": 0, "b": 40, "c": 40}
    slot_b = mirror.slots["b"].index
    assert not mirror.k[0][:, slot_b, :40].any(), "b's borrowed prefix was written"
    assert mirror.k[0][:, slot_b, 40:b.computed].abs().sum() > 0
    run_both(h, backend, gather, [(s, s.chunk()) for s in (x, c, b)])     # a, the holder, left
    assert min(mirror.slots[r].borrowed for r in "bc") == 0, "nobody holds the group's prefix"
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 10**9)              # the plan is declined
    run_both(h, backend, gather, [(s, s.chunk()) for s in (b, x, c)])
    assert [mirror.slots[r].borrowed for r in "bcx"] == [0, 0, 0]
    assert [len(s.output) for s in (a, x, b, c)] == [3, 5, 4, 4]


def poison_unheld_positions(monkeypatch) -> None:
    """After every plan, fill each mirror position the mirror does not claim to hold (free
    slots, borrowed ranges, past a slot's length) with a large finite value, so any read of one
    that the masks do not hide changes the step's logprobs (a read of a zero might not)."""
    import radixserve.runner.attention.decode_mirror as dm

    plan = dm.DecodeMirror.plan

    def poisoned(self, kv, d, continuing):
        step = plan(self, kv, d, continuing)
        if step is not None:
            held = {slot.index: slot for slot in self.slots.values()}
            for buf in self.k + self.v:
                for index in range(self.num_slots):
                    slot = held.get(index)
                    if slot is None:
                        buf[:, index] = 37.0
                    else:
                        buf[:, index, :slot.borrowed] = 37.0
                        buf[:, index, slot.length:] = 37.0
        return step

    monkeypatch.setattr(dm.DecodeMirror, "plan", poisoned)


@pytest.mark.parametrize("seed", [0, 1])
def test_borrowed_slots_match_the_page_gather_path_through_random_churn(gqa_dir, monkeypatch, seed):
    """Sequences behind different amounts of one prefix join, leave, come back, have their
    first page remapped (a recompute: they stop sharing), and verify 2-token chunks, while the
    cascade plan is randomly taken or declined: every step's tokens and logprobs equal the
    page-gather path's, and slots did borrow. Positions the mirror does not hold are poisoned.
    (A helper's wider version of this, 80 random cases over page sizes 1-16, FP8 KV and the
    mirror over budget, passed on 2026-12-03.)"""
    import random

    from radixserve.runner.attention.torch_backend import TorchAttentionBackend
    from tests.model.test_decode_mirror import remap_pages, run_both

    rng = random.Random(seed)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 4)
    poison_unheld_positions(monkeypatch)
    h = Harness(gqa_dir, page_size=4, seed=20 + seed)
    backend, gather = TorchAttentionBackend(h.runner.kv), TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    mirror = backend.mirror
    root = h.new_seq("root", 48)
    run_both(h, backend, gather, [(root, root.chunk())])
    seqs = [shared(h, root, f"s{i}", rng.randint(2, 11), rng.randint(2, 7)) for i in range(7)]
    run_both(h, backend, gather, [(s, s.chunk()) for s in seqs] + [(root, root.chunk())])
    live = seqs + [root]
    borrowed, remapped = 0, 0
    for _ in range(24):
        monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", rng.choice([-10**9, 10**9]))
        batch = rng.sample(live, rng.randint(2, len(live)))
        if rng.random() < 0.15:
            remap_pages(h, batch[0])
            remapped += 1
        if rng.random() < 0.15:
            batch[-1].output += [rng.randrange(3, h.vocab) for _ in range(2)]   # a verify chunk
        run_both(h, backend, gather, [(s, s.chunk()) for s in batch])
        borrowed = max([borrowed] + [slot.borrowed for slot in mirror.slots.values()])
    assert borrowed > 0 and remapped > 0
