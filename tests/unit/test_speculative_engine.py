"""Speculative decoding in the engine, over the fake runner in copy mode (most drafts right,
some wrong): every per-token rule holds for accepted tokens exactly as without speculation
(cases C33-C36: max_tokens never overshot, stop ids and EOS end inside an accepted run,
min_tokens, logprobs one per token, usage), rejected positions never reach the radix tree,
and preemption and aborts leave no page behind."""
from __future__ import annotations

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeRunner

VOCAB = 500
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


ALGORITHMS = {"ngram": SPEC, "draft": {"speculative_algorithm": "draft",
                                       "speculative_num_draft_tokens": 4,
                                       "speculative_draft_layers": 1}}


def make_engine(spec: bool | str, num_pages: int = 256, eos: int | None = None,
                eos_every: int = 0, hooks=()) -> Engine:
    """`spec`: False, True (n-gram) or an ALGORITHMS key (draft: the fake runner's own drafts)."""
    runner = FakeRunner(num_pages, 4, VOCAB, 4096, eos, eos_every, copy_period=6)
    extra = ALGORITHMS["ngram" if spec is True else spec] if spec else {}
    return Engine(EngineConfig(page_size=4, chunked_prefill_size=64, **extra), runner, hooks=hooks)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, dict] = {rid: {"ids": [], "lps": 0} for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id]["ids"] += out.new_token_ids
            got[out.request_id]["lps"] += len(out.new_logprobs or [])
            if out.finished:
                got[out.request_id]["reason"] = out.finish_reason
        engine.check_invariants()
    return got


PROMPTS = {f"r{i}": [(7 * i + j) % 97 + 3 for j in range(6)] * (2 + i % 3) for i in range(6)}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("case", ["length", "stop_id", "eos", "min_tokens", "logprobs", "preemption"])
def test_rules_hold_for_accepted_tokens(case, algorithm):
    eos = 3 if case in ("eos", "min_tokens") else None
    eos_every = 5 if case == "min_tokens" else 40   # min_tokens: EOS is likely and masked at first
    params = {
        "length": SamplingParams(max_tokens=13, temperature=0),
        "stop_id": SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[PROMPTS["r1"][2]]),
        "eos": SamplingParams(max_tokens=60, temperature=0),
        "min_tokens": SamplingParams(max_tokens=60, min_tokens=12, temperature=0),
        "logprobs": SamplingParams(max_tokens=30, temperature=0, logprobs=1),
        "preemption": SamplingParams(max_tokens=40, temperature=0),
    }[case]
    pages = 24 if case == "preemption" else 256
    plain = run(make_engine(False, pages, eos, eos_every), PROMPTS, params)
    engine = make_engine(algorithm, pages, eos, eos_every)
    spec = run(engine, PROMPTS, params)
    assert spec == plain
    s = engine.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]      # some drafts rejected
    assert s["num_generated_tokens"] == sum(len(g["ids"]) for g in spec.values())
    assert all(len(g["ids"]) <= params.max_tokens for g in spec.values())
    if case == "preemption":
        assert s["num_preemptions"] > 0
    if case in ("stop_id", "eos", "min_tokens"):
        assert any(g["reason"] == "stop" for g in spec.values())
    if case == "min_tokens":
        assert all(len(g["ids"]) >= 12 for g in spec.values())
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_rejected_positions_never_reach_the_radix_tree(algorithm):
    """The fake KV holds token ids and the fake model reads its context back from the pages, so
    a rejected draft token left in a cached page would change the second round's output, which
    hits the cache for prompt + output of the first."""
    engine = make_engine(algorithm)
    params = SamplingParams(max_tokens=40, temperature=0)
    first = run(engine, PROMPTS, params)
    assert engine.stats()["spec_num_accepted_tokens"] < engine.stats()["spec_num_draft_tokens"]
    longer = {f"{rid}b": PROMPTS[rid] + g["ids"] for rid, g in first.items()}
    cached_before = engine.counters["num_cached_tokens"]
    second = run(engine, longer, params)
    assert engine.counters["num_cached_tokens"] - cached_before >= sum(len(p) for p in longer.values()) // 2
    reference = run(make_engine(False), longer, params)
    assert [g["ids"] for g in second.values()] == [g["ids"] for g in reference.values()]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_abort_mid_verify_returns_every_page(algorithm):
    engine = make_engine(algorithm)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=60, temperature=0))
    for _ in range(6):
        engine.step()
    for rid in list(PROMPTS)[::2]:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    s = engine.stats()
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_acceptance_counts_add_up_per_request_and_by_position(algorithm):
    """C36: each request's counts (as its usage reports them) sum to the engine's totals; every
    emitted token is an accepted draft or one step's own token; rates stay in [0, 1]; and by
    draft position, proposals and acceptances never rise (position i+1 is only accepted after i)."""
    engine = make_engine(algorithm)
    params = SamplingParams(max_tokens=50, temperature=0)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    last, emitted = {}, {rid: 0 for rid in PROMPTS}
    while engine.has_unfinished():
        for out in engine.step():
            emitted[out.request_id] += len(out.new_token_ids)
            if out.spec is not None:
                last[out.request_id] = out.spec
    s = engine.stats()
    assert sum(c.verify_steps for c in last.values()) == s["spec_num_verify_steps"] > 0
    assert sum(c.draft_tokens for c in last.values()) == s["spec_num_draft_tokens"]
    assert sum(c.accepted_tokens for c in last.values()) == s["spec_num_accepted_tokens"]
    for rid, c in last.items():
        assert 0 <= c.accept_rate <= 1 and 1 <= c.accept_length <= 1 + 4
        assert c.accepted_tokens + c.verify_steps <= emitted[rid]
    drafted, accepted = s["spec_num_draft_by_position"], s["spec_num_accepted_by_position"]
    assert sum(drafted) == s["spec_num_draft_tokens"] and sum(accepted) == s["spec_num_accepted_tokens"]
    assert drafted == sorted(drafted, reverse=True) and accepted == sorted(accepted, reverse=True)
    assert all(a <= d for a, d in zip(accepted, drafted))


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_inference_drafts_depend_only_on_the_request(deterministic):
    """--enable-deterministic-inference: a request's drafts, hence its seeded tokens, are the
    same alone and beside others (no batch gate, no shared table). Without it the batch gate
    drafts less at batch 32 for a request whose drafts are often rejected."""
    def drafts_of_r0(others: int) -> list[tuple[int, ...]]:
        runner = FakeRunner(1024, 4, VOCAB, 4096, None, 0, copy_period=6)
        engine = Engine(EngineConfig(page_size=4, chunked_prefill_size=512,
                                     enable_deterministic_inference=deterministic, **SPEC), runner)
        run(engine, {"warm": PROMPTS["r2"]}, SamplingParams(max_tokens=30, temperature=0))
        seen: list[tuple[int, ...]] = []
        propose = engine.scheduler.proposer.propose

        def spy(request_id, tokens, limit):
            out = propose(request_id, tokens, limit)
            if request_id == "r0":
                seen.append(tuple(out))
            return out
        engine.scheduler.proposer.propose = spy
        # r0 repeats a period of 5, the fake model copies from 6 back: its drafts often fail.
        prompts = {"r0": [11, 12, 13, 14, 15] * 4,
                   **{f"o{i}": PROMPTS[f"r{1 + i % 5}"][i % 4:] for i in range(others)}}
        run(engine, prompts, SamplingParams(max_tokens=40, temperature=0))
        return seen

    alone, crowded = drafts_of_r0(0), drafts_of_r0(31)
    assert (alone == crowded) is deterministic


@pytest.mark.parametrize("quantization, flag, expected", [(None, None, 16.0), ("int4-fp32", None, 4.0),
                                                          ("int4-fp32", 9.0, 9.0)])
def test_the_batch_gate_takes_the_runners_cost_model_unless_set(quantization, flag, expected):
    runner = FakeRunner(64, 4, VOCAB)
    if quantization is not None:
        runner.info = lambda: {"device": "none (fake runner)", "quantization": quantization}
    engine = Engine(EngineConfig(page_size=4, speculative_break_even_tokens=flag, **SPEC), runner)
    assert engine.scheduler.proposer.break_even_tokens == expected


@pytest.mark.parametrize("flag", [float("nan"), -1.0, "16", True])
def test_a_break_even_that_is_not_a_number_at_least_0_is_refused(flag):
    """NaN would fail every comparison and turn the gate off unannounced; a str or bool is not a token count."""
    with pytest.raises(ValueError, match="speculative_break_even_tokens must be a number >= 0"):
        EngineConfig(page_size=4, speculative_break_even_tokens=flag, **SPEC)
