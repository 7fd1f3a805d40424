"""Engine + model runner vs Hugging Face transformers: same greedy tokens (fp32; 32 new tokens on
the tiny model, 16 on the default one).

Scenarios from the foundation issue, on a tiny random-weight Llama and on the embedded default
model: (a) one request at a time, (b) all in one call, (c) again after a warm-up so the radix
cache hits, (d) a chunk size smaller than most prompts, (e) a KV budget that forces preemption.
Only a true tie (top-2 logit gap < 1e-4) may differ.
"""
from __future__ import annotations

import random

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from tests.model.parity import DEFAULT_NEW, assert_parity, engine_generate, hf_greedy, hf_greedy_batch

NUM_NEW = 32


def prompt_set(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# 22 prompts from 1 token to longer than two chunks of the default scenario (chunk 128).
LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 48, 64, 65, 90, 127, 128, 129, 160, 200, 257, 300, 333, 20]
SCENARIOS = {
    "a_one_at_a_time": dict(at_once=False, cfg={}),
    "b_all_at_once": dict(at_once=True, cfg={}),
    "c_warm_cache": dict(at_once=True, cfg={}, warm=True),
    "d_small_chunks": dict(at_once=True, cfg={"chunked_prefill_size": 32}),
    "e_preemption": dict(at_once=True, cfg={"max_total_tokens": 768}),
}


def make_engine(model_path, faults: bool = False, **cfg):
    """The engine over `model_path` with the hooks its config asks for; `faults`: with fault
    injection attached too (faults_of)."""
    from radixserve.chaos.engine_faults import EngineFaults
    from radixserve.compose import engine_hooks
    from radixserve.runner.model_runner import ModelRunner

    # Parity with transformers' fp32 weights: unquantized whatever --quantization's default.
    cfg = {"page_size": 16, "chunked_prefill_size": 128, "max_total_tokens": 16384,
           "quantization": "none", **cfg}
    config = EngineConfig(model_path=str(model_path), **cfg)
    hooks = engine_hooks(config) + ([EngineFaults()] if faults else [])
    return Engine(config, ModelRunner.from_config(config), hooks=hooks)


def faults_of(engine):
    """The EngineFaults attached to `engine` (make_engine(faults=True))."""
    from radixserve.chaos.engine_faults import EngineFaults
    return next(h for h in engine.hooks.hooks if isinstance(h, EngineFaults))


def run_scenario(model_path, prompts, refs, name, num_new=NUM_NEW, **cfg):
    spec = SCENARIOS[name]
    engine = make_engine(model_path, **{**spec["cfg"], **cfg})
    if spec.get("warm"):
        engine_generate(engine, prompts, 1)  # warm-up: every prompt's pages enter the cache
    outs, cached = engine_generate(engine, prompts, num_new, at_once=spec["at_once"])
    for i, (ours, (ref, logits)) in enumerate(zip(outs, refs)):
        assert_parity(ours, ref, logits, f"{name} prompt {i} (len {len(prompts[i])})")
    if spec.get("warm"):
        assert all(c > 0 for c, p in zip(cached, prompts) if len(p) > 16), cached
    if name == "e_preemption":
        assert engine.stats()["num_preemptions"] > 0
    s = engine.stats()
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]
    return engine


@pytest.fixture(scope="module")
def tiny_case(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    prompts = prompt_set(hf.config.vocab_size, 0, LENGTHS)
    return prompts, hf_greedy_batch(hf, prompts, NUM_NEW)


def test_batched_reference_equals_one_prompt_at_a_time(tiny_llama_dir, tiny_case):
    """The references come from one left-padded batch (hf_greedy_batch): the same tokens as
    transformers run on each prompt alone, logits within the tie margin."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    prompts, refs = tiny_case
    for prompt, (tokens, logits) in zip(prompts, refs):
        alone_tokens, alone_logits = hf_greedy(hf, prompt, NUM_NEW)
        assert tokens == alone_tokens
        assert max(float((a - b).abs().max()) for a, b in zip(logits, alone_logits)) < 1e-4


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_tiny_llama_parity(tiny_llama_dir, tiny_case, name):
    prompts, refs = tiny_case
    run_scenario(tiny_llama_dir, prompts, refs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_default_model_parity(default_gguf, default_case, name):
    prompts, refs = default_case
    if name == "a_one_at_a_time":
        # Every third prompt (short to longest): the serial scenario costs DEFAULT_NEW steps per
        # prompt on a 135M model, and the batched scenarios b-e run all 15.
        prompts, refs = prompts[::3], refs[::3]
    # 16 new tokens grow the batch too little to preempt within e's 768 tokens: a smaller
    # budget that still holds the longest prompt (300) and its new tokens.
    cfg = {"max_total_tokens": 448} if name == "e_preemption" else {}
    run_scenario(default_gguf, prompts, refs, name, DEFAULT_NEW, **cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["b_all_at_once", "c_warm_cache", "e_preemption"])
def test_default_model_parity_at_the_served_defaults(default_gguf, default_case, name):
    """--quantization auto as served: int4-fp32 where its kernel has a vector path here (decode steps of <= 16 tokens
    on the kernel, larger ones on the fp32 copy), else fp32; the same bound against transformers' fp32."""
    from radixserve.layers import int4_fp32

    prompts, refs = default_case
    cfg = {"max_total_tokens": 448} if name == "e_preemption" else {}
    engine = run_scenario(default_gguf, prompts, refs, name, DEFAULT_NEW, quantization="auto", **cfg)
    served = engine.runner.config
    own = int4_fp32.chosen_isa() in int4_fp32.VECTOR_ISAS
    assert (served.quantization, served.quantized_max_tokens) == (("int4-fp32", 16) if own else ("none", 0))
