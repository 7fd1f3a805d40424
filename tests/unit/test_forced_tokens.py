"""The sampler.force_tokens fault point in the engine: exact sequences, finish checks, counts, KV."""
from __future__ import annotations

import random

import pytest

from radixserve.chaos.engine_faults import EngineFaults
from radixserve.chaos.forced_tokens import ForcedTokens
from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from tests.unit.test_engine import assert_idle_pool, rand_prompt, reference, run_all
from tests.unit.test_engine import make_engine as make_plain_engine

FORCED = [7, 700, 70, 7, 999]


def make_engine(**kw):
    """The test engine with fault injection attached; returns (engine, its EngineFaults)."""
    faults = EngineFaults()
    return make_plain_engine(hooks=[faults], **kw), faults


def test_forced_sequence_then_the_model_samples_on_over_the_forced_context():
    """The forced tokens come out exactly; after them the fake model's tokens are the reference
    continuation of prompt + forced tokens, so the KV written for forced tokens is theirs."""
    engine, faults = make_engine()
    prompt = [1, 2, 3, 4, 5]
    faults.arm_forced_tokens(FORCED)
    engine.add_request("a", prompt, SamplingParams(max_tokens=9, logprobs=1))
    ids, final = run_all(engine)["a"]
    assert ids[:5] == FORCED
    assert ids[5:] == reference(prompt + FORCED, 4)
    assert final.finish_reason == "length"
    assert_idle_pool(engine)


def test_count_and_arrival_order():
    engine, faults = make_engine()
    faults.arm_forced_tokens([5, 6], count=2)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [9, 9, 9], SamplingParams(max_tokens=2))
    out = run_all(engine)
    assert out["a"][0] == out["b"][0] == [5, 6]
    assert out["c"][0] == reference([9, 9, 9], 2)
    engine.add_request("d", [9, 9, 9], SamplingParams(max_tokens=2))
    assert run_all(engine)["d"][0] == reference([9, 9, 9], 2)   # used up


def test_forced_tokens_pass_the_usual_finish_checks():
    engine, faults = make_engine(eos=999)
    faults.arm_forced_tokens(FORCED, count=4)
    engine.add_request("eos", [1, 2], SamplingParams(max_tokens=20))
    engine.add_request("short", [1, 2], SamplingParams(max_tokens=2))
    engine.add_request("stop_id", [1, 2], SamplingParams(max_tokens=20, stop_token_ids=(70,)))
    engine.add_request("min", [1, 2], SamplingParams(max_tokens=5, min_tokens=5))
    out = run_all(engine)
    assert out["eos"][0] == FORCED and out["eos"][1].finish_reason == "stop"
    assert out["eos"][1].stop_token_id == 999
    assert out["short"][0] == FORCED[:2] and out["short"][1].finish_reason == "length"
    assert out["stop_id"][0] == FORCED[:3] and out["stop_id"][1].stop_token_id == 70
    # min_tokens masks eos in the sampler only; a forced eos at the 5th token ends it by length
    assert out["min"][0] == FORCED and out["min"][1].finish_reason == "length"
    assert_idle_pool(engine)


def test_forced_logprob_is_certain_and_top_list_stays_the_models():
    engine, faults = make_engine()
    faults.arm_forced_tokens([3])
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=1, logprobs=1))
    final = run_all(engine)["a"][1]
    (lp,) = final.new_logprobs
    sampled = reference([1, 2], 1)[0]
    assert lp.token_id == 3 and lp.logprob == 0.0 and lp.top == [(sampled, -0.5)]


def test_preempted_request_keeps_its_forced_tokens():
    rng = random.Random(3)
    engine, faults = make_engine(num_pages=24, page_size=4, chunked_prefill_size=32)
    forced = [rng.randrange(1000) for _ in range(30)]
    prompts = {f"q{i}": rand_prompt(rng, 20, 30) for i in range(12)}
    faults.arm_forced_tokens(forced, count=len(prompts))
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=40))
    out = run_all(engine)
    assert engine.stats()["num_preemptions"] > 0
    for rid, p in prompts.items():
        assert out[rid][0] == forced + reference(p + forced, 10), rid
    assert_idle_pool(engine)


def test_disarm_and_expiry():
    engine, faults = make_engine()
    faults.arm_forced_tokens([5], count=10)
    faults.disarm_forced_tokens()
    engine.add_request("a", [4, 4], SamplingParams(max_tokens=1))
    assert run_all(engine)["a"][0] == reference([4, 4], 1)
    armed = ForcedTokens((5,), num_left=3, ends_s=100.0)
    assert armed.take(99.0) == (5,) and armed.num_left == 2
    assert armed.take(100.0) is None and armed.is_spent   # expired


@pytest.mark.parametrize("token_ids, count, param", [
    ([], 1, "token_ids"), ([1000], 1, "token_ids"), ([-1], 1, "token_ids"), ([1], 0, "count")])
def test_bad_arguments_are_refused(token_ids, count, param):
    engine, faults = make_engine()
    with pytest.raises(InvalidRequest) as err:
        faults.arm_forced_tokens(token_ids, count=count)
    assert err.value.param == param
    engine.add_request("a", [4, 4], SamplingParams(max_tokens=1))
    assert run_all(engine)["a"][0] == reference([4, 4], 1)   # nothing armed


def test_forced_tokens_under_speculative_decoding_match_plain_decoding():
    """Drafts verified in one step are replaced by forced tokens like single samples: the run
    is cut after the first replaced token and its draft KV is not kept, so the outputs (and
    the model's samples after the forced part) are those of plain decoding."""
    from tests.unit.test_speculative_engine import PROMPTS, make_engine as make_spec_engine
    from tests.unit.test_speculative_engine import run as run_spec

    forced = (PROMPTS["r2"][:6] * 3)[:14] + [11, 12]   # repeats the prompt: n-gram drafts follow
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
    results = []
    for spec in (False, True):
        faults = EngineFaults()
        engine = make_spec_engine(spec, hooks=[faults])
        faults.arm_forced_tokens(forced, count=len(PROMPTS))
        results.append(run_spec(engine, PROMPTS, params))
    plain, speculative = results
    assert speculative == plain
    assert all(got["ids"][:len(forced)] == forced for got in plain.values())
    assert engine.stats()["spec_num_verify_steps"] > 0
