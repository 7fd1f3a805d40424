"""MLA (glm4_moe_lite) under the smallest chunks and at every page size: C45's end-to-end repro (prompt logprobs of a
batch mixing 10-chunk prompts, short ones and prefix hits, against transformers; decodes through the cascade merge)
and C46 (page sizes 1, 2, 3, 16, 64; fp32 against transformers, bf16 / fp8 latent against page size 1).
The merge arithmetic: tests/unit/test_attention_merge.py."""
from __future__ import annotations

import math
import random

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner.attention.cascade import merge_states
from radixserve.runner.batch import build_step
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from tests.model.parity import assert_parity, engine_generate
from tests.model.test_mla import build_mla
from tests.model.test_parity import make_engine
from tests.model.test_runner import Seq

VOCAB = 512


@pytest.fixture(scope="module")
def mla_case(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_mla(tmp_path_factory.mktemp("mla"), vocab_size=VOCAB)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def serve(engine, prompts: dict[str, list[int]], echo: set[str]) -> dict[str, tuple[list[int], list[float], int]]:
    """All `prompts` admitted at once; per request (the tokens scored, their logprobs, cached tokens): for `echo`
    requests the prompt's positions 1.. (prompt logprobs, max_tokens 1: the cache is bypassed), for the others 4
    greedy tokens (prompt + output tokens, the outputs' logprobs)."""
    lps: dict[str, list[float]] = {rid: [] for rid in prompts}
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1)
                           if rid in echo else SamplingParams(max_tokens=4, temperature=0, logprobs=1))
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in echo and o.prompt_logprobs is not None:
                lps[o.request_id] = [e.logprob for e in o.prompt_logprobs]
            elif o.request_id not in echo:
                outs[o.request_id] += o.new_token_ids
                lps[o.request_id] += [e.logprob for e in o.new_logprobs]
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
        engine.check_invariants()
    return {rid: (prompts[rid] + outs[rid], lps[rid], cached[rid]) for rid in prompts}


@torch.inference_mode()
def test_c45_prompt_logprobs_under_the_smallest_chunks_equal_a_cold_unchunked_run(mla_case):
    """chunked_prefill_size 16 (one page): 160- and 150-token prompts take 10 steps each, short prompts share the
    budget, and prefix hits (6 pages, 4 pages, the whole prompt) read the cached latent in the same steps as echo
    prompts' chunks; every logprob finite and within 1e-3 of transformers' one cold forward."""
    folder, hf = mla_case
    engine = make_engine(folder, page_size=16, chunked_prefill_size=16, max_total_tokens=2048)
    a, b = tokens(160, 1), tokens(150, 2)
    serve(engine, {"warm_a": a, "warm_b": b}, set())            # caches a and b (echo requests bypass the cache)
    prompts = {"long_a": a, "long_b": b, "short_5": tokens(5, 3), "short_12": tokens(12, 4),
               "hit_a": a[:96] + tokens(30, 5), "hit_b": b[:64] + tokens(3, 6), "again_a": a}
    echo = {"long_a", "long_b", "short_5", "short_12"}
    seen = serve(engine, prompts, echo)
    assert [seen[rid][2] for rid in ("long_a", "hit_a", "hit_b", "again_a")] == [0, 96, 64, 144]
    for rid, (ids, lps, _) in seen.items():
        assert len(lps) == (len(ids) - 1 if rid in echo else 4) and all(math.isfinite(x) for x in lps), rid
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
        want = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)[-len(lps):]
        assert float((torch.tensor(lps) - want).abs().max()) <= 1e-3, rid



def test_c45_mla_decodes_through_the_cascade_merge_like_transformers(mla_case, monkeypatch):
    """The one (output, LSE) merge on the MLA path: cascade decode over the latent mirror (prefix part read once,
    suffix part; a sequence in no group has an empty suffix), every token checked against transformers."""
    import radixserve.runner.attention.cascade as cascade
    from tests.model.test_cascade_attention import shared
    from tests.model.test_runner import Harness

    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", -10**9)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 8)
    merges = []
    monkeypatch.setattr(cascade, "merge_states", lambda *a: merges.append(1) or merge_states(*a))
    h = Harness(mla_case[0], page_size=8, seed=5)
    a, x = h.new_seq("a", 70), h.new_seq("x", 30)
    h.step([(a, a.chunk()), (x, x.chunk())])
    b, c = shared(h, a, "b", 6, 5), shared(h, a, "c", 4, 9)
    h.step([(b, b.chunk()), (c, c.chunk()), (a, a.chunk()), (x, x.chunk())])
    for _ in range(4):
        h.step([(s, s.chunk()) for s in (c, a, x, b)])
    assert merges, "the cascade merge was never used"
    assert [len(s.output) for s in (a, x, b, c)] == [6, 6, 5, 5]

PAGE_SIZES = [1, 2, 3, 16, 64]
NUM_NEW = 64


def lengths(page: int) -> list[int]:
    """C46's P - 1, P, P + 1, 3P + 1 and four more: a batch of 8 mixed lengths."""
    edges = [n for n in (page - 1, page, page + 1, 3 * page + 1) if n > 0]
    return edges + [1, 7, 2 * page + 3, 40, 5][:8 - len(edges)]


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_c46_greedy_at_every_page_size_equals_transformers_cold_and_warm(mla_case, page):
    """fp32: a batch of 8 mixed lengths, 64 greedy tokens, cold then again (radix hits on whole pages) equal to
    transformers' (tie rule); the engine reports (its stats, served by /debug/pages) and runs the configured page size."""
    from tests.model.parity import hf_greedy_batch

    folder, hf = mla_case
    prompts = [tokens(n, seed=100 * page + i) for i, n in enumerate(lengths(page))]
    assert len(prompts) == 8
    refs = hf_greedy_batch(hf, prompts, NUM_NEW)
    engine = make_engine(folder, page_size=page, chunked_prefill_size=max(64, page), max_total_tokens=4096)
    assert engine.stats()["page_size"] == engine.runner.page_size == engine.runner.kv.page_size == page   # served
    for run in ("cold", "warm"):
        outs, cached = engine_generate(engine, prompts, NUM_NEW)
        for i, (out, (ref, ref_logits)) in enumerate(zip(outs, refs)):
            assert_parity(out, ref, ref_logits, f"page {page} {run} prompt {i} ({len(prompts[i])} tokens)")
        if run == "warm":
            assert all(c == (len(p) - 1) // page * page for c, p in zip(cached, prompts)), cached


def batch_logits(folder, page: int, dtype: str, kv_dtype: str, prompts: list[list[int]]) -> torch.Tensor:
    """Every logit row of the prompts prefilled together (the longer ones in two chunks, the second reading the
    first's latent through the page table), then 3 batched greedy decodes; (rows, V) fp32."""
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=page, dtype=dtype,
                                                  kv_cache_dtype=kv_dtype, max_total_tokens=2048 // page * page))
    free = list(range(runner.num_pages))[::-1]
    seqs = [Seq(f"s{i}", p, [free.pop() for _ in range(-(-(len(p) + 4) // page))]) for i, p in enumerate(prompts)]
    rows, last = [], {}

    def step(chunks: list[tuple[Seq, int | None]]) -> None:
        scheduled = [s.chunk(n) for s, n in chunks]
        batch = build_step(scheduled, runner.page_size, runner.device)
        logits = runner.model(batch.input_ids, batch.positions, runner.backend.prepare(batch), None)
        end = 0
        for (s, _), sched in zip(chunks, scheduled):
            s.computed += len(sched.input_ids)
            end += len(sched.input_ids)
            last[s.rid] = logits[end - 1]
        rows.append(logits.float())

    with torch.inference_mode():
        step([(s, len(s.prompt) // 2 if len(s.prompt) > 8 else None) for s in seqs])
        step([(s, None) for s in seqs if s.computed < len(s.prompt)])
        for _ in range(3):
            for s in seqs:
                s.output.append(int(last[s.rid].argmax()))
            step([(s, None) for s in seqs])
    return torch.cat(rows)


@pytest.mark.parametrize("dtype,kv_dtype", [("bfloat16", "auto"), ("float32", "fp8_e4m3"), ("bfloat16", "fp8_e4m3")])
def test_c46_bf16_and_fp8_latent_at_every_page_size_equal_page_size_1(mla_case, dtype, kv_dtype):
    """The same batch of 8 mixed lengths (P - 1 .. 3P + 1 of each P) gives page size 1's logits at every page size,
    in bf16 and with an fp8 latent (the page size changes nothing but where the latent lives)."""
    folder, _ = mla_case
    for page in PAGE_SIZES[1:]:
        prompts = [tokens(n, seed=100 * page + i) for i, n in enumerate(lengths(page))]
        ours, ref = (batch_logits(folder, p, dtype, kv_dtype, prompts) for p in (page, 1))
        err = float((torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max())
        assert err <= 1e-3, f"page {page}: logprobs differ by {err:.3g}"
