"""Speculative decoding on GLM-5's DSA (glm_moe_dsa): n-gram drafts and a self-draft (the first layers, with their own
latent KV and index keys, runner/draft.py) give transformers' greedy tokens, over prompts past index_topk, chunked
prefill and radix hits; a full-depth self-draft proposes exactly what the target then samples."""
from __future__ import annotations

import random

import pytest
import torch

from tests.model.parity import assert_parity, engine_generate, hf_greedy
from tests.model.test_dsa import TOPK, build_dsa
from tests.model.test_parity import make_engine

NUM_NEW = 16
CASES = {"ngram": {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4},
         "self_draft_1": {"speculative_algorithm": "draft", "speculative_draft_layers": 1},
         "self_draft_full": {"speculative_algorithm": "draft", "speculative_draft_layers": 3}}


@pytest.fixture(scope="module")
@torch.inference_mode()
def dsa_case(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_dsa(tmp_path_factory.mktemp("dsa-spec"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    rng = random.Random(7)
    prompts = []
    for n in (TOPK - 3, 20, 45, 70):             # one dense prompt, the rest sparse; segments repeat for n-gram
        seg = [rng.randrange(3, 512) for _ in range(max(n // 3, 2))]
        prompts.append((seg * 3)[:n])
    return folder, prompts, [hf_greedy(hf, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_with_speculation_equals_transformers(dsa_case, name):
    folder, prompts, refs = dsa_case
    engine = make_engine(folder, chunked_prefill_size=32, **CASES[name])
    engine_generate(engine, prompts[2:], NUM_NEW)     # radix hits; n-gram: the shared table then drafts the answer
    outs, cached = engine_generate(engine, prompts, NUM_NEW)
    for i, (ours, (ref, logits)) in enumerate(zip(outs, refs)):
        assert_parity(ours, ref, logits, f"{name} prompt {i}")
    assert sum(cached) > 0
    s = engine.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] > 0, s
    if name == "self_draft_full":     # the target itself: only numerical near-ties may reject
        assert s["spec_num_accepted_tokens"] >= 0.95 * s["spec_num_draft_tokens"], s
