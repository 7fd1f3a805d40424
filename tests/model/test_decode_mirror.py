"""DecodeMirror (contiguous per-sequence KV kept across steps) vs gathering pages every step.

A random scenario drives one runner: sequences join (after a prefill), leave, skip steps,
have their pages remapped with new content (what radix dedup or a recompute may do), and
grow past the mirror's capacity; holes force out-of-order slots and compaction. Every step
runs with the mirror, then again with the gather path (the reference: the paged cache is the
source of truth); outputs must agree. A mirror over its byte budget must fall back. A lone
decode reads the pages in place instead (decode_attention_paged), handing over to the mirror
and back as the batch changes.
"""
from __future__ import annotations

import pytest
import torch

from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.torch_backend import TorchAttentionBackend, TorchStepAttention
from tests.model.test_runner import Harness, Seq


def run_both(h: Harness, mirror: TorchAttentionBackend, gather: TorchAttentionBackend,
             items: list[tuple[Seq, object]]) -> None:
    """One step through the gather path (the reference), then the same batch with the mirror
    (rewriting the same KV): same tokens and logprobs."""
    batch = [s for _, s in items]
    h.runner.backend = gather
    ref = h.runner.run(batch)
    h.runner.backend = mirror
    got = h.runner.run(batch)
    for (seq, sched), r, g in zip(items, ref, got):
        seq.computed = sched.start_pos + len(sched.input_ids)
        if not sched.sample:
            continue
        assert g.token_ids[-1] == r.token_ids[-1], f"{seq.rid}: mirror and gather disagree"
        assert g.logprobs[-1].logprob == pytest.approx(r.logprobs[-1].logprob, abs=1e-5)
        assert [t for t, _ in g.logprobs[-1].top] == [t for t, _ in r.logprobs[-1].top]
        seq.output.append(g.token_ids[-1])


def remap_pages(h: Harness, seq: Seq) -> None:
    """Move a sequence's first page to a fresh page id with perturbed content (a recompute)."""
    old, new = seq.pages[0], h.free.pop()
    kv = h.runner.kv
    pages = kv.export_pages([old])
    kv.import_pages([new], type(pages)(pages.k * 1.5, pages.v * 1.5, pages.side))
    seq.pages = [new] + seq.pages[1:]


@pytest.mark.parametrize("page_size", [1, 8])
def test_mirror_matches_gather_through_churn(gqa_dir, page_size):
    h = Harness(gqa_dir, page_size, seed=page_size)
    backend, gather = TorchAttentionBackend(h.runner.kv), TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    mirror = backend.mirror
    a, b, c, d = h.new_seq("a", 20), h.new_seq("b", 9), h.new_seq("c", 1), h.new_seq("d", 12)

    def step(*seqs: Seq) -> None:
        run_both(h, backend, gather, [(s, s.chunk()) for s in seqs])

    step(a, b, c)                     # prefills; c (1 token) already decodes
    step(a, b, c)
    step(a, b, c)
    assert sorted(mirror.slots[r].index for r in "abc") == [0, 1, 2]
    step(a, c, d)                     # b skips a step: its slot is freed; d prefills
    assert "b" not in mirror.slots
    step(d, a, b, c)                  # b and d re-enter: slots out of batch order
    assert [mirror.slots[r].index for r in "dabc"] != [0, 1, 2, 3]
    remap_pages(h, a)                 # a's first page moves and changes: a must be re-copied
    step(d, a, b, c)
    step(c, b)                        # a and d leave: holes
    remap_pages(h, b)
    step(b, c, a)
    step(a, b, c, d)
    assert len(a.output) == 8 and len(d.output) == 4


@pytest.mark.skipif(not decode_kernel.supported_isas(), reason="radixserve/csrc not built")
@pytest.mark.parametrize("page_size,kv_dtype", [(1, "auto"), (16, "auto"), (16, "bfloat16")])
def test_paged_reads_match_gather_and_hand_over_to_the_mirror(gqa_dir, page_size, kv_dtype):
    """A lone decode reads the cache's pages in place (no mirror step), also inside a step with a prefill, with the
    decode row first or not; joining a batch hands it to the mirror (its stale slot topped up), leaving hands it back;
    with cascade off a whole batch reads pages. Every step agrees with the gather path (bf16 storage: read in place
    as bf16, widened in the kernel)."""
    h = Harness(gqa_dir, page_size, seed=11, kv_cache_dtype=kv_dtype)
    backend, gather = TorchAttentionBackend(h.runner.kv), TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    assert backend.reads_pages
    a, b, c = h.new_seq("a", 40), h.new_seq("b", 9), h.new_seq("c", 23)

    def step(*seqs: Seq, through: TorchAttentionBackend = backend) -> TorchStepAttention:
        """run_both on `through`; its prepared step attention."""
        prepared, real = [], through.prepare
        through.prepare = lambda s: prepared.append(real(s)) or prepared[-1]
        try:
            run_both(h, through, gather, [(s, s.chunk()) for s in seqs])
        finally:
            through.prepare = real
        return prepared[0]

    step(a)                                      # prefill
    assert step(a).paged is not None             # a decodes alone
    step(a, b)                                   # a decodes, b prefills (decode row first)
    assert step(b, a).paged is None              # both decode: the mirror
    assert backend.mirror.slots["a"].length == len(a.tokens) - 1
    assert step(c, a).paged is not None          # b left; c prefills before a's decode row
    assert step(a).paged is not None and set(backend.mirror.slots) == {"a"}   # a's slot kept, stale
    assert step(a, c).paged is None              # the mirror again: a's slot tops up
    no_cascade = TorchAttentionBackend(h.runner.kv, cascade=False)
    assert step(c, a, through=no_cascade).paged is not None
    assert len(a.output) == 8 and len(c.output) == 3


def test_mirror_grows_and_compacts(gqa_dir):
    h = Harness(gqa_dir, 16, seed=3)
    mirror, gather = TorchAttentionBackend(h.runner.kv), TorchAttentionBackend(h.runner.kv, mirror_bytes=0)
    seqs = [h.new_seq(f"s{i}", 100 if i == 0 else 5, max_len=300) for i in range(8)]
    run_both(h, mirror, gather, [(s, s.chunk()) for s in seqs])
    for _ in range(2):
        run_both(h, mirror, gather, [(s, s.chunk()) for s in seqs])
    first_capacity = mirror.mirror.capacity
    keep = [seqs[0], seqs[7]]                                                  # slots 0 and 7: holes
    for _ in range(first_capacity):                   # until seqs[0] passes the first capacity
        run_both(h, mirror, gather, [(s, s.chunk()) for s in keep])
        if mirror.mirror.capacity > first_capacity:
            break
    assert mirror.mirror.capacity > first_capacity
    assert max(slot.index for slot in mirror.mirror.slots.values()) < 2 + 4


def test_mirror_over_budget_falls_back_to_gather(gqa_dir):
    h = Harness(gqa_dir, 16, seed=4)
    tiny = TorchAttentionBackend(h.runner.kv, mirror_bytes=1)
    h.runner.backend = tiny
    seqs = [h.new_seq(f"s{i}", n) for i, n in enumerate([3, 30])]
    for _ in range(3):
        h.step([(s, s.chunk()) for s in seqs])
    assert tiny.mirror.num_slots == 0 and not tiny.mirror.slots
    assert all(len(s.output) == 3 for s in seqs)


def test_mirror_is_dropped_when_no_decode(gqa_dir):
    h = Harness(gqa_dir, 16, seed=5)
    backend = TorchAttentionBackend(h.runner.kv, paged=False)   # a decodes alone: mirrored only without paged
    h.runner.backend = backend
    a, b = h.new_seq("a", 10), h.new_seq("b", 20)
    h.step([(a, a.chunk())])
    h.step([(a, a.chunk())])                                                    # a decodes
    assert set(backend.mirror.slots) == {"a"}
    h.step([(b, b.chunk())])                                                    # prefill only
    assert not backend.mirror.slots
    h.step([(a, a.chunk()), (b, b.chunk())])
    assert set(backend.mirror.slots) == {"a", "b"}
    assert torch.all(torch.isfinite(backend.mirror.k[0]))


def test_slot_behind_after_a_verify_chunk_catches_up(gqa_dir):
    """A decoding sequence spends a step on a short multi-token chunk (a speculative verify of
    two draft tokens) while another decodes: its slot is kept, then catches up by copying only
    the missing tokens; every token still matches transformers (the Harness checks each)."""
    h = Harness(gqa_dir, 16, seed=6)
    backend = TorchAttentionBackend(h.runner.kv)
    h.runner.backend = backend
    a, b = h.new_seq("a", 30), h.new_seq("b", 12)
    h.step([(a, a.chunk()), (b, b.chunk())])
    for _ in range(2):
        h.step([(a, a.chunk()), (b, b.chunk())])                               # both decode
    before = backend.mirror.slots["a"].length
    a.output += [5, 9]                                                           # two "accepted drafts"
    h.step([(b, b.chunk()), (a, a.chunk())])                                     # a: 3-token chunk
    assert backend.mirror.slots["a"].length == before                             # kept, behind
    h.step([(a, a.chunk()), (b, b.chunk())])                                     # a decodes: catch-up
    assert backend.mirror.slots["a"].length == len(a.tokens) - 1
    h.step([(a, a.chunk())])                                                     # b left: slot freed
    assert set(backend.mirror.slots) == {"a"}


def test_kept_slot_counts_against_capacity(gqa_dir):
    """A slot kept for a verifying sequence plus a full decode group need more slots than the
    mirror has: it grows (re-copying) instead of running out (a crash seen under load)."""
    h = Harness(gqa_dir, 16, seed=8)
    backend = TorchAttentionBackend(h.runner.kv)
    h.runner.backend = backend
    seqs = [h.new_seq(f"s{i}", 5 + i) for i in range(17)]
    h.step([(s, s.chunk()) for s in seqs[:8]])
    h.step([(s, s.chunk()) for s in seqs[:8]])                                  # 8 decode: 16 slots
    h.step([(s, s.chunk()) for s in seqs])                                      # 8 decode, 9 prefill
    assert backend.mirror.num_slots == 16
    seqs[0].output += [7, 11]                                                    # s0 verifies a draft
    h.step([(s, s.chunk()) for s in seqs])                                      # 16 decode + 1 kept
    assert backend.mirror.num_slots >= 17
    h.step([(s, s.chunk()) for s in seqs])
    assert all(len(s.output) >= 3 for s in seqs[8:])


def test_decode_attention_takes_a_non_contiguous_sdpa_output(monkeypatch):
    """CUDA's SDPA may return its (B, KV, rep, D) output with other strides; decode_attention must
    give the same (B, H, D) result whatever the layout (it crashed with .view on an H200)."""
    import torch.nn.functional as F

    from radixserve.runner.attention import decode_mirror

    torch.manual_seed(0)
    batch, num_kv, rep, length, head_dim = 3, 2, 2, 5, 8
    q = torch.randn(batch, num_kv * rep, head_dim)
    k, v = torch.randn(2, batch, num_kv, length, head_dim)
    mask = torch.zeros(batch, 1, 1, length)
    expected = decode_mirror.decode_attention(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)                    # (B, KV, rep, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)   # same values, not contiguous

    monkeypatch.setattr(decode_mirror.F, "scaled_dot_product_attention", strided_sdpa)
    assert not strided_sdpa(q.view(batch, num_kv, rep, head_dim), k, v, attn_mask=mask).is_contiguous()
    torch.testing.assert_close(decode_mirror.decode_attention(q, k, v, mask), expected, rtol=0, atol=0)
