"""Speculative decoding across turns and under sampling: C34 (logprobs on the verify
path) and C35 (the radix cache after speculative finishes), on the tiny model.

Prompts repeat segments so the n-gram proposer drafts and the tiny model accepts some drafts
(test_speculative.py's copy-heavy prompts). C35 found that a verify step which finished a
request left its accepted tokens out of the radix commit: a page of the next turn's hit lost.
"""
from __future__ import annotations

import math

import pytest
import torch

from radixserve.sampling_params import SamplingParams
from tests.model.test_parity import make_engine
from tests.model.test_speculative import SELF_DRAFT_HALF, SPEC, copy_heavy_prompts

PAGE = 16


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Run `requests` together; per request its tokens, logprobs, finish reason and cached count.
    Checks the page invariant after every step."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got = {rid: {"ids": [], "logprobs": [], "reason": None, "cached": 0} for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            g = got[out.request_id]
            g["ids"] += out.new_token_ids
            g["logprobs"] += out.new_logprobs or []
            if out.finished:
                g["reason"], g["cached"] = out.finish_reason, out.num_cached_tokens
        engine.check_invariants()
    return got


def test_sampled_logprobs_with_speculation_are_the_target_models(tiny_llama_dir):
    """C34: sampling with a seed, logprobs 5: one entry per generated token, accepted
    drafts included; each is the target model's raw log-probability of the sampled token at its
    position (transformers over prompt + output, teacher-forced), never a placeholder; the top 5
    are the target's five largest, so their probabilities sum to at most 1. Temperature 0.1:
    the tiny random model's loops, which the drafts copy, survive only low temperatures (from
    0.3 up nothing is drafted at all), and the sampled verify path runs at any temperature > 0."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    prompts = copy_heavy_prompts(hf.config.vocab_size, 3)[:6]
    engine = make_engine(tiny_llama_dir, **SPEC)
    requests = {f"s{i}": (p, SamplingParams(max_tokens=30, temperature=0.1, seed=i, logprobs=5,
                                                   ignore_eos=True))
                for i, p in enumerate(prompts)}
    got = _run(engine, requests)
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0, "no draft was accepted: the test would prove nothing"
    for rid, (prompt, _) in requests.items():
        ids, lps = got[rid]["ids"], got[rid]["logprobs"]
        assert len(ids) == len(lps) == 30, rid
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1)                          # (30, vocab)
        for pos, (tok, lp) in enumerate(zip(ids, lps)):
            assert lp.token_id == tok and lp.logprob <= 0.0, (rid, pos)
            assert abs(lp.logprob - float(ref[pos, tok])) < 1e-4, (rid, pos, lp.logprob, float(ref[pos, tok]))
            assert len(lp.top) == 5
            assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5, (rid, pos)
            assert {t for t, _ in lp.top} == set(ref[pos].topk(5).indices.tolist()), (rid, pos)
        assert any(lp.logprob < -1e-6 for lp in lps), f"{rid}: every logprob is 0.0"


@pytest.mark.parametrize("algorithm", [SPEC, SELF_DRAFT_HALF], ids=["ngram", "self_draft"])
def test_multi_turn_reuse_with_speculation_matches_no_cache_no_speculation(tiny_llama_dir, algorithm):
    """C35: sessions of 3 turns, each turn's prompt the previous prompt, what was delivered and a
    new question; turns end by length or by stop tokens (some the session's loops copy, often
    inside an accepted draft run; one that may never come). With speculation and the radix cache, every turn from the second hits
    at least the previous prompt and completion less a page and two tokens (accepted tokens past
    a stop must not enter the cache key), within a page of the hits without speculation, and
    every output equals the run with neither speculation nor the cache."""
    vocab = 384                                  # prompt ids; the tiny model has 512
    prompts = copy_heavy_prompts(vocab, 5)[:6]
    questions = [[7 + t, 11 + t, 13 + t] for t in range(3)]

    def params(session: int, turn: int) -> SamplingParams:
        kind = (session + turn) % 3
        if kind == 0:
            return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        # Stop on tokens of the session's own prompt: its loops copy them, often in a draft run.
        stops = tuple(prompts[session][1:4]) if kind == 1 else (vocab + 5,)
        return SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=stops)

    def sessions(engine) -> list[list[dict]]:
        history = [list(p) for p in prompts]
        turns: list[list[dict]] = [[] for _ in prompts]
        for t in range(3):
            requests = {f"t{t}-s{s}": (history[s], params(s, t)) for s in range(len(prompts))}
            got = _run(engine, requests)
            for s in range(len(prompts)):
                g = got[f"t{t}-s{s}"]
                turns[s].append({**g, "prompt": len(history[s])})
                history[s] = history[s] + g["ids"] + questions[t]
        return turns

    spec = make_engine(tiny_llama_dir, **algorithm)
    with_spec = sessions(spec)
    without_spec = sessions(make_engine(tiny_llama_dir))
    reference = sessions(make_engine(tiny_llama_dir, disable_radix_cache=True))
    stats = spec.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    reasons = {turn["reason"] for turns in with_spec for turn in turns}
    assert {"stop", "length"} <= reasons, reasons
    for s in range(len(prompts)):
        for t in range(3):
            a, b, ref = with_spec[s][t], without_spec[s][t], reference[s][t]
            assert a["ids"] == ref["ids"] and a["reason"] == ref["reason"], (s, t)
            assert b["ids"] == ref["ids"], (s, t)
            if t:
                before = with_spec[s][t - 1]
                assert a["cached"] >= before["prompt"] + len(before["ids"]) - PAGE - 2, (s, t, a["cached"])
                assert a["cached"] >= b["cached"] - PAGE, (s, t)
    assert spec.stats()["num_free_pages"] + spec.stats()["num_cached_pages"] == spec.stats()["num_pages"]


def test_a_repeated_prompt_in_a_mixed_batch_matches_its_first_run(tiny_llama_dir):
    """C35, draft slots over shared pages: prompts run once, then again each beside fresh
    prompts in one batch, with speculation and the radix cache: the repeats hit every full page
    before their last token and produce what they produced alone, and the fresh prompts what a
    plain engine gives them."""
    prompts = copy_heavy_prompts(384, 7)
    repeated, fresh = prompts[2:6], copy_heavy_prompts(384, 8)[2:6]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = make_engine(tiny_llama_dir, **SPEC)
    first = _run(engine, {f"a{i}": (p, params) for i, p in enumerate(repeated)})
    mixed = {}
    for i in range(len(repeated)):
        mixed[f"r{i}"] = (repeated[i], params)
        mixed[f"f{i}"] = (fresh[i], params)
    again = _run(engine, mixed)
    plain = _run(make_engine(tiny_llama_dir), {f"f{i}": (p, params) for i, p in enumerate(fresh)})
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    for i, p in enumerate(repeated):
        assert again[f"r{i}"]["ids"] == first[f"a{i}"]["ids"], i
        assert again[f"r{i}"]["cached"] >= (len(p) - 1) // PAGE * PAGE, (i, again[f"r{i}"]["cached"])
        assert again[f"f{i}"]["ids"] == plain[f"f{i}"]["ids"], i
