"""MLA (glm4_moe_lite) under the smallest chunks and at every page size: C45's end-to-end repro (prompt logprobs of a
batch mixing 10-chunk prompts, short ones and prefix hits, against transformers) and C46 (page sizes 1, 2, 3, 16, 64,
fp32 / bf16 / fp8 latent, equal to page size 1's fp32 output). The merge arithmetic itself: tests/unit/test_attention_merge.py."""
from __future__ import annotations

import math
import random

import pytest
import torch

from radixserve.sampling_params import SamplingParams
from tests.model.parity import assert_parity, engine_generate
from tests.model.test_mla import build_mla
from tests.model.test_parity import make_engine

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
