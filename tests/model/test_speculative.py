"""N-gram speculative decoding (issue 12): lossless greedy and sampling, per-token rules, KV rollback.

Prompts repeat segments so the proposer finds matches (a tiny random model greedily falls into
loops, which drafts then copy). Greedy output with speculation equals transformers' (tie rule)
in the five scheduling scenarios of test_parity.py, on the tiny model and on the default one,
with drafts proposed and accepted, and the page invariant checked after every step; a seed
reproduces; the sampler's verification draws tokens with exactly the target distribution
(chi-square). Per-token rules: test_speculative_engine.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.layers.sampler import Sampler
from radixserve.sampling_params import SamplingParams
from tests.model.parity import DEFAULT_NEW, assert_parity, engine_generate, hf_greedy
from tests.model.test_parity import NUM_NEW, SCENARIOS, make_engine

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


def copy_heavy_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for n in (8, 20, 33, 64, 100, 150):
        seg = [rng.randrange(3, vocab) for _ in range(max(n // 3, 2))]
        prompts.append(seg * 3 + seg[:n % 7])
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 17, 90)]   # no matches
    return prompts


@pytest.fixture(scope="module")
def spec_case(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    prompts = copy_heavy_prompts(hf.config.vocab_size, 0)
    return prompts, [hf_greedy(hf, p, NUM_NEW) for p in prompts]


# A self-draft of all the tiny model's layers is the target itself: with its KV kept in step
# (runner/draft.py) it must propose exactly what the target then samples.
SELF_DRAFT_FULL = {"speculative_algorithm": "draft", "speculative_draft_layers": 2}
SELF_DRAFT_HALF = {"speculative_algorithm": "draft", "speculative_draft_layers": 1}


def run_spec_scenario(model_dir, spec_case, name: str, algorithm: dict, num_new: int = NUM_NEW) -> dict:
    prompts, refs = spec_case
    spec = SCENARIOS[name]
    engine = make_engine(model_dir, **{**spec["cfg"], **algorithm})
    if spec.get("warm"):
        engine_generate(engine, prompts, 1)
    outs, _ = engine_generate(engine, prompts, num_new, at_once=spec["at_once"])
    for i, (ours, (ref, logits)) in enumerate(zip(outs, refs)):
        assert_parity(ours, ref, logits, f"{name} prompt {i}")
    s = engine.stats()
    assert s["spec_num_accepted_tokens"] > 0 and s["spec_num_verify_steps"] < s["num_generated_tokens"]
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]
    if name == "e_preemption":
        assert s["num_preemptions"] > 0
    return s


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_with_speculation_matches_transformers(tiny_llama_dir, spec_case, name):
    run_spec_scenario(tiny_llama_dir, spec_case, name, SPEC)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_with_speculation_matches_transformers_on_the_default_model(default_gguf, default_case, name):
    """The default model's parity prompts (test_parity.py: its texts, and spans of them
    repeated, so n-gram drafts find matches) with n-gram drafts, fp32, against transformers."""
    prompts, refs = default_case
    if name == "a_one_at_a_time":   # as in test_default_model_parity: every third prompt
        prompts, refs = prompts[::3], refs[::3]
    budget = {"max_total_tokens": 448} if name == "e_preemption" else {}
    run_spec_scenario(default_gguf, (prompts, refs), name, {**SPEC, **budget}, DEFAULT_NEW)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_with_a_self_draft_matches_transformers(tiny_llama_dir, spec_case, name):
    s = run_spec_scenario(tiny_llama_dir, spec_case, name, SELF_DRAFT_FULL)
    # The full-depth draft is the target: every draft token is accepted but for numerical ties
    # (and the drafts the engine drops when a request is preempted or ends).
    assert s["spec_num_accepted_tokens"] >= 0.95 * s["spec_num_draft_tokens"]


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A tiny model whose greedy output depends on its context (the tied one soon repeats one
    token whatever it reads, so a draft with wrong KV would still agree with it)."""
    from tests.conftest import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("untied"), tie_word_embeddings=False, seed=3)


def test_a_full_depth_self_draft_proposes_what_the_target_samples(untied_dir):
    """Only if the draft's own KV holds every position's KV (the sync after each target step,
    radix-cache hits and chunked prefill included) does the target-identical draft keep
    agreeing with the target."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 40, 70, 130)]
    cfg = {"chunked_prefill_size": 32}
    plain = engine_generate(make_engine(untied_dir, **cfg), prompts, 24)[0]
    engine = make_engine(untied_dir, **cfg, **SELF_DRAFT_FULL)
    engine_generate(engine, prompts[:2], 1)        # their pages enter the radix cache
    assert engine_generate(engine, prompts, 24)[0] == plain
    s = engine.stats()
    assert s["spec_num_verify_steps"] >= 4 * 3
    assert s["spec_num_accepted_tokens"] >= 0.95 * s["spec_num_draft_tokens"]


@pytest.mark.parametrize("name", ["b_all_at_once", "e_preemption"])
def test_greedy_with_a_shallower_self_draft_matches_transformers(tiny_llama_dir, spec_case, name):
    run_spec_scenario(tiny_llama_dir, spec_case, name, SELF_DRAFT_HALF)


def _run(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_invariants()
    return tokens


def test_seeded_sampling_with_speculation_reproduces(tiny_llama_dir):
    prompt = copy_heavy_prompts(384, 2)[3]
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    runs = [_run(make_engine(tiny_llama_dir, **SPEC), prompt, params) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 40


def test_verification_samples_the_target_distribution():
    """Chi-square over 3,000 seeds per draft: the first emitted token of a verify step (draft
    accepted, or the residual draw) has the distribution of an ordinary step (T 0.7, top-k 3:
    p = 0.58, 0.28, 0.14), for a likely draft and one outside the top-k. Critical value: p = 0.001
    for 2 degrees of freedom; a 3-point bias moved from the second to the first token gives an
    expected chi-square of 14, so biases of that size and more fail it."""
    temperature, top_k = 0.7, 3
    vocab = 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]] * 3)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    expected = torch.softmax(logits[0] / temperature, -1)
    if top_k > 0:
        expected[top_k:] = 0
        expected /= expected.sum()
    sampler = Sampler(vocab, frozenset())

    class Row:
        request_id, prompt_ids, output_ids, min_tokens_left = "r", [1], [], 0

        def __init__(self, seed):
            self.seed, self.params = seed, params

    for draft in ([0, 1], [5, 2]):
        counts = torch.zeros(vocab)
        n = 3000
        for seed in range(n):
            ids, _ = sampler.verify(logits, Row(seed), draft)
            counts[ids[0]] += 1
        mask = expected > 0
        assert counts[~mask].sum() == 0
        chi2 = float((((counts - n * expected) ** 2) / (n * expected))[mask].sum())
        dof = int(mask.sum()) - 1
        assert dof == 2 and chi2 < 13.82, (draft, counts.tolist(), chi2)


def test_logprobs_of_accepted_tokens_match_ordinary_steps(tiny_llama_dir):
    """Each accepted token's logprob and top-3 come from its own position's raw logits."""
    prompt = copy_heavy_prompts(384, 3)[4]
    params = SamplingParams(max_tokens=30, temperature=0, logprobs=3, ignore_eos=True)

    def run(engine):
        engine.add_request("r", prompt, params)
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_logprobs or []
        return got, engine

    plain, _ = run(make_engine(tiny_llama_dir))
    spec, engine = run(make_engine(tiny_llama_dir, **SPEC))
    assert engine.stats()["spec_num_accepted_tokens"] > 0 and len(spec) == len(plain) == 30
    for a, b in zip(spec, plain):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_separate_draft_model_is_loaded_and_checked(untied_dir, tmp_path):
    """--speculative-draft-model-path: a copy of the target as the draft agrees with it; a
    shallower random model as the draft changes nothing in the output; a draft with another
    vocabulary is refused."""
    from tests.conftest import build_tiny_llama

    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (12, 60)]
    plain = engine_generate(make_engine(untied_dir), prompts, 20)[0]
    copy = make_engine(untied_dir, speculative_algorithm="draft",
                       speculative_draft_model_path=str(untied_dir))
    assert engine_generate(copy, prompts, 20)[0] == plain
    s = copy.stats()
    assert s["spec_num_accepted_tokens"] >= 0.95 * s["spec_num_draft_tokens"] > 0
    small = build_tiny_llama(tmp_path / "small", tie_word_embeddings=False, seed=9,
                             num_hidden_layers=1)
    other = make_engine(untied_dir, speculative_algorithm="draft",
                        speculative_draft_model_path=str(small))
    assert engine_generate(other, prompts, 20)[0] == plain
    wrong = build_tiny_llama(tmp_path / "wrong", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(untied_dir, speculative_algorithm="draft", speculative_draft_model_path=str(wrong))
