"""PD engines over the fake runner: parity with the reference, the first token counted once, layout refusal, failures reach the request as errors."""
from __future__ import annotations

import random

import pytest

from tests.unit.pd_helpers import FakeClock, Rig, greedy, pd_engine, target
from tests.unit.test_engine import reference

VOCAB = 1000


@pytest.fixture
def pair():
    p, d = pd_engine("prefill"), pd_engine("decode")
    rig = Rig(p, d)
    yield p, d, rig
    rig.close()


def assert_idle(*engines):
    for e in engines:
        e.check_invariants()
        s = e.stats()
        assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"], s
        assert s["pd"]["num_quarantined_pages"] == 0


def test_parity_with_colocated_reference(pair):
    p, d, rig = pair
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 3, 4, 5, 8, 9, 16, 23, 40)]
    prompts.append(prompts[-1][:20] + [7, 7, 7])     # shares a prefix: a prefill-side cache hit
    for i, prompt in enumerate(prompts):
        rig.submit(p, d, f"r{i}", prompt, greedy(6), room=100 + i)
    rig.finish(*(f"r{i}" for i in range(len(prompts))))
    for i, prompt in enumerate(prompts):
        assert rig.tokens[f"r{i}"] == reference(prompt, 6), i
        assert rig.finals[f"r{i}"].finish_reason == "length"
    assert rig.finals["r9"].num_cached_tokens > 0      # the prefill side's hit is reported
    rig.idle()
    assert_idle(p, d)
    assert d.stats()["pd"]["transfers_succeeded"] == len(prompts)
    assert d.stats()["num_generated_tokens"] == 6 * len(prompts)   # first token counted once


def test_max_tokens_one_gives_one_token_with_logprob(pair):
    p, d, rig = pair
    prompt = [5, 6, 7, 8, 9]
    rig.submit(p, d, "one", prompt, greedy(1, logprobs=2), room=1)
    rig.finish("one")
    final = rig.finals["one"]
    assert rig.tokens["one"] == reference(prompt, 1)
    assert final.finish_reason == "length"
    rig.idle()
    assert d.stats()["num_generated_tokens"] == 1


def test_first_token_logprobs_travel(pair):
    p, d, rig = pair
    outs = []
    p.add_request("p-x", [1, 2, 3], greedy(3, logprobs=1), target(p, 9))
    d.add_request("x", [1, 2, 3], greedy(3, logprobs=1), target(p, 9))
    while len(outs) < 1 or not outs[-1].finished:
        p.step()
        outs += [o for o in d.step() if o.request_id == "x"]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in lps] == reference([1, 2, 3], 3)


def test_layout_mismatch_fails_fast_naming_both_values():
    p, d = pd_engine("prefill", page_size=4), pd_engine("decode", page_size=8)
    rig = Rig(p, d)
    try:
        rig.submit(p, d, "m", [1, 2, 3, 4, 5], greedy(4), room=5)
        rig.finish("m", "p-m")
        err = rig.finals["m"].error
        assert rig.finals["m"].error_code == "kv_transfer_failed"
        assert "page_size" in err and "4" in err and "8" in err, err
        assert rig.finals["p-m"].error_code == "kv_transfer_failed"
        rig.idle()
        assert_idle(p, d)
    finally:
        rig.close()


def test_transfer_timeout_fails_the_request_and_frees_pages_after_the_ack():
    clock = FakeClock()
    p, d = pd_engine("prefill", clock=clock), pd_engine("decode", clock=clock,
                                                        disaggregation_transfer_timeout=5.0)
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.prefill.start", "hang")
        rig.submit(p, d, "t", list(range(10)), greedy(4), room=7)
        rig.run_until(lambda: d.stats()["pd"]["num_waiting_for_kv"] == 1, "prealloc")
        clock.advance(6.0)
        rig.finish("t", "p-t")
        assert "timed out" in rig.finals["t"].error
        assert rig.finals["t"].error_code == "kv_transfer_failed"
        rig.idle()   # the ack comes back: nothing quarantined, nothing leaked
        assert_idle(p, d)
        assert d.stats()["pd"]["transfers_failed"] == 1
    finally:
        rig.close()


@pytest.mark.parametrize("point,action", [("pd.transfer.write", "fail"),
                                          ("pd.transfer.done", "fail"),
                                          ("pd.bootstrap", "fail")])
def test_failed_edge_reaches_decode_as_error_and_pair_keeps_serving(pair, point, action):
    p, d, rig = pair
    p.faults.arm(point, action, count=1)
    prompt = list(range(12))
    rig.submit(p, d, "bad", prompt, greedy(3), room=11)
    rig.finish("bad")
    assert rig.finals["bad"].error_code == "kv_transfer_failed", rig.finals["bad"]
    assert rig.tokens.get("bad", []) == []
    rig.submit(p, d, "good", prompt, greedy(3), room=12)    # one failure does not poison the pair
    rig.finish("good")
    assert rig.tokens["good"] == reference(prompt, 3)
    rig.idle()
    assert_idle(p, d)


@pytest.mark.parametrize("action", ["delay", "duplicate"])
def test_delayed_or_duplicated_writes_do_not_change_output(pair, action):
    p, d, rig = pair
    p.faults.arm("pd.transfer.write", action, delay_ms=5, delay_max_ms=20)
    d.faults.arm("pd.decode.prealloc", "delay", delay_ms=1, delay_max_ms=10)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    for i, prompt in enumerate(prompts):
        rig.submit(p, d, f"r{i}", prompt, greedy(5), room=200 + i)
    rig.finish(*(f"r{i}" for i in range(8)))
    for i, prompt in enumerate(prompts):
        assert rig.tokens[f"r{i}"] == reference(prompt, 5)
    rig.idle()
    assert_idle(p, d)


def test_request_without_target_is_refused(pair):
    from radixserve.errors import InvalidRequest
    p, d, _ = pair
    with pytest.raises(InvalidRequest, match="bootstrap_room"):
        d.add_request("x", [1, 2], greedy(2))


def test_unreachable_bootstrap_address_fails_the_request():
    from radixserve.disagg.protocol import PDTarget
    d = pd_engine("decode")
    rig = Rig(d)
    try:
        d.add_request("x", [1, 2, 3], greedy(2), PDTarget("not a host", 1, 3))
        rig.finish("x")
        assert rig.finals["x"].error_code == "kv_transfer_failed"
        assert "cannot reach" in rig.finals["x"].error
        rig.idle()
        d.check_invariants()
        assert d.stats()["num_free_pages"] == d.stats()["num_pages"]
    finally:
        rig.close()


@pytest.mark.parametrize("decode_first", [False, True])
def test_legs_with_different_prompts_fail_instead_of_decoding_wrong_kv(pair, decode_first):
    from radixserve.errors import KVTransferFailed
    p, d, rig = pair
    if decode_first:
        d.add_request("x", [1, 2, 3, 4, 5], greedy(3), target(p, 31))
        rig.run_until(lambda: 31 in p.prefill.rooms, "the Expect")
        with pytest.raises(KVTransferFailed, match="disagree on the prompt"):
            p.add_request("p-x", [1, 2, 3, 4, 6], greedy(3), target(p, 31))
    else:
        p.add_request("p-x", [1, 2, 3, 4, 6], greedy(3), target(p, 31))
        d.add_request("x", [1, 2, 3, 4, 5], greedy(3), target(p, 31))
    rig.finish("x")
    assert "disagree on the prompt" in rig.finals["x"].error
    rig.idle()
    assert p.engine.requests == {} and d.engine.requests == {}
    d.check_invariants()
    assert d.stats()["num_free_pages"] + d.stats()["num_cached_pages"] == d.stats()["num_pages"]


def test_max_tokens_zero_scores_the_prompt_only(pair):
    p, d, rig = pair
    rig.submit(p, d, "z", [4, 5, 6, 7, 8, 9], greedy(0, prompt_logprobs=1), room=41)
    rig.finish("z")
    final = rig.finals["z"]
    assert rig.tokens.get("z", []) == [] and final.finish_reason == "length"
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == 5
    rig.idle()
    assert d.stats()["num_generated_tokens"] == 0
