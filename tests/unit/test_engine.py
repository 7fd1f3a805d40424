"""Engine + scheduler + KV manager over the fake runner: outputs, sharing, preemption, abort."""
from __future__ import annotations

import random

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.errors import ContextLengthExceeded, InvalidRequest
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeRunner, reference_next_token

VOCAB = 1000


def make_engine(num_pages=64, page_size=4, eos=None, eos_every=0, max_context_len=4096, hooks=(),
                **cfg):
    cfg.setdefault("chunked_prefill_size", 32)
    runner = FakeRunner(num_pages, page_size, VOCAB, max_context_len, eos, eos_every)
    return Engine(EngineConfig(page_size=page_size, **cfg), runner, hooks=hooks)


def reference(prompt, max_tokens, eos=None, eos_every=0):
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = reference_next_token(ids, VOCAB, eos, eos_every)
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out


def run_all(engine, check=True, on_step=None):
    """Step until idle; return {request_id: (token_ids, final EngineOutput)}."""
    tokens, finals, step = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if check:
            engine.check_invariants()
        if on_step:
            on_step(step)
        step += 1
        assert step < 10_000, "engine did not finish"
    return {rid: (tokens.get(rid, []), finals[rid]) for rid in finals}


def assert_idle_pool(engine):
    engine.check_invariants()
    s = engine.stats()
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]
    assert engine.kv.cache.num_locked_pages == 0


def rand_prompt(rng, lo, hi):
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


def test_single_request_matches_reference():
    engine = make_engine()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, temperature=0))
    out = run_all(engine)
    assert out["a"][0] == reference(prompt, 10)
    assert out["a"][1].finish_reason == "length"
    assert_idle_pool(engine)


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (4, 8), (4, 32), (16, 16)])
def test_many_requests_chunked_prefill(page_size, chunk):
    rng = random.Random(page_size * 100 + chunk)
    engine = make_engine(num_pages=4096 // page_size, page_size=page_size, chunked_prefill_size=chunk)
    prompts = {f"r{i}": rand_prompt(rng, 1, 60) for i in range(20)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=rng.randint(1, 12)))
    out = run_all(engine)
    for rid, p in prompts.items():
        ids, final = out[rid]
        assert ids == reference(p, len(ids)), rid
        assert final.num_prompt_tokens == len(p)
    assert_idle_pool(engine)


def test_prefix_hit_on_repeat_is_page_aligned_and_capped():
    engine = make_engine(page_size=4)
    for n in [1, 2, 3, 4, 5, 7, 8, 9]:  # C04: shorter than a page, exact pages, one over
        prompt = list(range(10, 10 + n))
        results = []
        for k in range(2):
            engine.add_request(f"p{n}-{k}", prompt, SamplingParams(max_tokens=3))
            results.append(run_all(engine)[f"p{n}-{k}"])
        cold, warm = results
        assert cold[0] == warm[0] == reference(prompt, 3)
        cached = warm[1].num_cached_tokens
        assert cached % 4 == 0 and cached <= n - 1
        if n >= 5:
            assert cached >= 4
    assert_idle_pool(engine)


def test_in_batch_prefix_sharing_prefills_once():
    engine = make_engine(num_pages=256, page_size=4, chunked_prefill_size=64)
    prefix = list(range(100, 140))  # 40 tokens = 10 pages
    for i in range(4):
        engine.add_request(f"s{i}", prefix + [500 + i], SamplingParams(max_tokens=2))
    runner = engine.runner
    out = run_all(engine)
    computed = sum(len(s.input_ids) for b in runner.steps for s in b)
    # One full prefill (41) + three suffix-only prefills (1 each) + 4 decode steps.
    assert computed == 41 + 3 * 1 + 4
    for i in range(4):
        assert out[f"s{i}"][0] == reference(prefix + [500 + i], 2)
        assert out[f"s{i}"][1].num_cached_tokens == (40 if i else 0)
    assert_idle_pool(engine)


def test_preemption_keeps_outputs_and_counts_no_false_hits():
    rng = random.Random(7)
    # 24 pages of 4 tokens: far too few for 12 requests of ~40 tokens each at once.
    engine = make_engine(num_pages=24, page_size=4, chunked_prefill_size=32)
    prompts = {f"q{i}": rand_prompt(rng, 20, 30) for i in range(12)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=40))
    out = run_all(engine)
    assert engine.stats()["num_preemptions"] > 0
    for rid, p in prompts.items():
        assert out[rid][0] == reference(p, 40), rid
        assert out[rid][1].num_cached_tokens == 0  # C19: recompute is not a cache hit
    assert engine.stats()["cache_hit_rate"] == 0.0
    assert_idle_pool(engine)


def test_request_too_big_for_kv_is_rejected_not_hung():
    engine = make_engine(num_pages=8, page_size=4)
    with pytest.raises(ContextLengthExceeded, match="32 tokens"):
        engine.add_request("big", list(range(30)), SamplingParams(max_tokens=10))
    engine.add_request("ok", list(range(20)), SamplingParams(max_tokens=12))
    assert run_all(engine)["ok"][0] == reference(list(range(20)), 12)


@pytest.mark.parametrize("abort_step", range(0, 14))
def test_abort_at_every_step_releases_pages(abort_step):
    rng = random.Random(abort_step)
    engine = make_engine(num_pages=40, page_size=4, chunked_prefill_size=16)
    prompts = {f"x{i}": rand_prompt(rng, 10, 40) for i in range(5)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=8))
    victim = "x2"
    computed_at_abort = {}

    def on_step(step):
        if step == abort_step and victim in engine.requests:
            computed_at_abort["n"] = engine.requests[victim].num_computed_tokens
            out = engine.abort(victim)
            assert out.finished and out.finish_reason == "abort"
            engine.check_invariants()
            # Aborted KV enters the tree only as far as it was really computed.
            assert engine.kv.cache.match_len(prompts[victim] + [0] * 64) <= max(
                computed_at_abort["n"], engine.kv.cache.match_len(prompts[victim]))
    out = run_all(engine, on_step=on_step)
    for rid, p in prompts.items():
        if rid != victim:
            assert out[rid][0] == reference(p, 8)
    assert engine.abort(victim) is None
    assert_idle_pool(engine)


def test_abort_waiting_request_and_unknown_id():
    engine = make_engine()
    engine.add_request("w", [1, 2, 3], SamplingParams(max_tokens=4))
    assert engine.abort("w").finish_reason == "abort"
    assert engine.abort("nope") is None
    assert not engine.has_unfinished()
    assert_idle_pool(engine)


def test_disable_radix_cache_frees_everything():
    engine = make_engine(disable_radix_cache=True)
    for k in range(2):
        engine.add_request(f"d{k}", list(range(30)), SamplingParams(max_tokens=5))
        out = run_all(engine)
        assert out[f"d{k}"][1].num_cached_tokens == 0
        assert out[f"d{k}"][0] == reference(list(range(30)), 5)
    assert engine.stats()["num_free_pages"] == engine.stats()["num_pages"]


def test_lpm_admits_longest_prefix_first():
    engine = make_engine(num_pages=256, page_size=4, chunked_prefill_size=64,
                         max_running_requests=1, schedule_policy="lpm")
    base = list(range(200, 240))
    engine.add_request("warm", base + [1], SamplingParams(max_tokens=1))
    run_all(engine)
    engine.add_request("cold", list(range(600, 640)), SamplingParams(max_tokens=1))
    engine.add_request("hot", base + [2], SamplingParams(max_tokens=1))
    first = engine.step()  # one slot: lpm must pick the request whose prefix is cached
    assert [o.request_id for o in first] == ["hot"]
    run_all(engine)
    assert_idle_pool(engine)


def test_eos_stop_tokens_min_tokens_ignore_eos():
    engine = make_engine(eos=0, eos_every=3)
    prompt = [5, 6, 7]
    engine.add_request("e", prompt, SamplingParams(max_tokens=50))
    ids, final = run_all(engine)["e"]
    assert ids == reference(prompt, 50, eos=0, eos_every=3)
    assert ids[-1] == 0 and final.finish_reason == "stop" and final.stop_token_id == 0
    engine.add_request("i", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    ids_i, final = run_all(engine)["i"]
    assert len(ids_i) == 20 and final.finish_reason == "length" and 0 in ids_i
    stop_tok = ids_i[2]
    engine.add_request("s", prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))
    ids, final = run_all(engine)["s"]
    assert ids == ids_i[:ids_i.index(stop_tok) + 1] and final.finish_reason == "stop"
    engine.add_request("m", prompt, SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=[stop_tok],
                                                  ignore_eos=True))
    ids, final = run_all(engine)["m"]
    assert len(ids) >= 5 and stop_tok not in ids[:5]
    assert_idle_pool(engine)


def test_max_tokens_zero_scores_prompt_only():
    engine = make_engine(page_size=4, chunked_prefill_size=8)
    prompt = list(range(1, 20))
    engine.add_request("z", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    ids, final = run_all(engine)["z"]
    assert ids == [] and final.finish_reason == "length"
    assert [lp.token_id for lp in final.prompt_logprobs] == prompt[1:]
    assert_idle_pool(engine)


def test_prompt_logprobs_bypass_cache():
    engine = make_engine(page_size=4)
    prompt = list(range(40, 70))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    run_all(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    final = run_all(engine)["b"][1]
    assert final.num_cached_tokens == 0
    assert len(final.prompt_logprobs) == len(prompt) - 1


@pytest.mark.parametrize("prompt,params,error", [
    ([], SamplingParams(), InvalidRequest),
    ([1, VOCAB], SamplingParams(), InvalidRequest),
    ([1, -1], SamplingParams(), InvalidRequest),
    ([1], SamplingParams(n=2), InvalidRequest),
    ([1], SamplingParams(temperature=-1), InvalidRequest),
    ([1] * 10, SamplingParams(max_tokens=5000), ContextLengthExceeded),
    ([1] * 4096, SamplingParams(max_tokens=None), ContextLengthExceeded),  # no room for one token
])
def test_add_request_validation(prompt, params, error):
    engine = make_engine(num_pages=2048)
    with pytest.raises(error):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()
    engine.add_request("good", [1, 2], SamplingParams(max_tokens=2))
    assert len(run_all(engine)["good"][0]) == 2


def test_flush_cache_only_when_idle():
    engine = make_engine()
    engine.add_request("a", list(range(30)), SamplingParams(max_tokens=2))
    assert engine.flush_cache() is False
    run_all(engine)
    assert engine.stats()["num_cached_pages"] > 0
    assert engine.flush_cache() is True
    assert engine.stats()["num_free_pages"] == engine.stats()["num_pages"]


def test_shared_prefix_workload_under_pressure_stays_consistent():
    """C03 in miniature: shared prefix + unique suffixes + small pool, then idle self-check."""
    rng = random.Random(3)
    engine = make_engine(num_pages=48, page_size=4, chunked_prefill_size=24, max_running_requests=8)
    system = rand_prompt(rng, 32, 32)
    prompts = {f"c{i}": system + rand_prompt(rng, 4, 12) for i in range(24)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=rng.randint(4, 16)))
    out = run_all(engine)
    for rid, p in prompts.items():
        assert out[rid][0] == reference(p, len(out[rid][0]))
    assert_idle_pool(engine)
    assert engine.stats()["token_usage"] == 0.0
    engine.add_request("after", system + [9], SamplingParams(max_tokens=3))
    assert run_all(engine)["after"][0] == reference(system + [9], 3)


def test_kv_checksum_flag_without_its_hooks_is_refused():
    """--enable-kv-checksum on an Engine built without ChecksumHooks would check nothing: a
    start-up error, never a silent no-op (compose.engine_hooks supplies the hooks)."""
    config = EngineConfig(page_size=4, enable_kv_checksum=True)
    with pytest.raises(ValueError, match="ChecksumHooks"):
        Engine(config, FakeRunner(64, 4, VOCAB, 4096, None, 0))
