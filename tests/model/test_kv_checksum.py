"""--enable-kv-checksum on the real runner: no false alarm in any scheduling scenario (parity
with transformers kept, speculation included), and KV overwritten after it was computed (the
kv_corrupt fault, noise and swap; a page shared through the radix tree) ends exactly the requests
that read it, with error_code kv_checksum_mismatch, leaks no page and leaves no damaged page in
the tree."""
from __future__ import annotations

import random

import pytest

from radixserve.chaos.tier_faults import CopyFaults
from radixserve.outputs import KV_CHECKSUM_ERROR
from radixserve.sampling_params import SamplingParams
from tests.model.test_parity import SCENARIOS, faults_of, make_engine
from tests.model.test_speculative import SPEC, run_spec_scenario, spec_case  # noqa: F401 (fixture)

CHECKED = {"enable_kv_checksum": True, "kv_checksum_interval": 1}   # every slot, every step
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_false_alarm_in_any_scenario(tiny_llama_dir, spec_case, name):
    s = run_spec_scenario(tiny_llama_dir, spec_case, name, {**SPEC, **CHECKED})
    assert s["num_kv_checksum_failures"] == 0 and s["kv_checksum_slots_mismatched"] == 0
    assert s["kv_checksum_slots_checked"] > sum(map(len, spec_case[0]))


def run(engine, prompts, arm=None, prefix="r"):
    """Final output and tokens per request; the page invariant checked after every step."""
    if arm is not None:
        faults_of(engine).arm_kv_corrupt(**arm)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, GREEDY)
    tokens, final = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        engine.check_invariants()
    return tokens, final


def prompts_of(n: int, seed: int, lo: int = 40, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("mode", ["noise", "swap"])
@pytest.mark.parametrize("interval", [1, 16])
def test_overwritten_kv_ends_the_request_that_reads_it(tiny_llama_dir, mode, interval):
    prompts = prompts_of(4, 3)
    cfg = {"disable_radix_cache": True}
    clean, _ = run(make_engine(tiny_llama_dir, **cfg), prompts)
    engine = make_engine(tiny_llama_dir, faults=True, **cfg, enable_kv_checksum=True, kv_checksum_interval=interval)
    hurt, final = run(engine, prompts, {"mode": mode, "fraction": 0.5, "after_tokens": 4, "seed": 1})
    (victim, at), = faults_of(engine).kv_corrupt_hits
    out = final[victim]
    assert out.error_code == KV_CHECKSUM_ERROR and out.finish_reason == "abort"
    assert hurt[victim] == clean[victim][:len(hurt[victim])]      # stopped, nothing else changed
    assert len(hurt[victim]) <= at + interval + 1                  # within one round of checks
    for rid in clean:
        if rid != victim:
            assert hurt[rid] == clean[rid] and final[rid].error_code is None
    assert engine.stats()["num_kv_checksum_failures"] == 1
    assert engine.kv.pool.num_free == engine.kv.num_pages


def test_a_damaged_shared_prefix_ends_its_readers_and_leaves_the_tree(tiny_llama_dir):
    """Two requests share a 64-token prefix held by the radix tree; the fault overwrites one of
    its pages. Both readers end with the mismatch, the page leaves the tree, and a later request
    with the same prefix computes it afresh and gets the clean answer."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(10)] for _ in range(2)]
    clean, _ = run(make_engine(tiny_llama_dir), prompts)
    engine = make_engine(tiny_llama_dir, faults=True, enable_kv_checksum=True, kv_checksum_interval=4)
    hurt, final = run(engine, prompts, {"mode": "noise", "fraction": 1.0, "after_tokens": 2, "seed": 2})
    assert faults_of(engine).kv_corrupt_hits
    assert all(out.error_code == KV_CHECKSUM_ERROR for out in final.values())
    assert engine.stats()["num_kv_checksum_failures"] == 2
    again, final = run(engine, prompts, prefix="again")
    assert [again[f"again{i}"] for i in range(2)] == [clean[f"r{i}"] for i in range(2)]
    assert all(out.error_code is None for out in final.values())
    assert engine.stats()["kv_checksum_slots_mismatched"] > 0
    engine.check_invariants()


def test_no_false_alarm_while_the_host_tier_evicts_and_reloads(tiny_llama_dir):
    """Pages that leave the device, come back from the host tier (every layer late) and are
    reused by other requests are re-sealed, never mistaken for overwritten."""
    from tests.model.test_hicache_model import SMALL_POOL, assert_same, rounds, sessions

    prompts = sessions()
    off = rounds(make_engine(tiny_llama_dir, **SMALL_POOL), prompts)
    engine = make_engine(tiny_llama_dir, enable_hierarchical_cache=True, **SMALL_POOL, **CHECKED)
    engine.runner.host_kv.fault = CopyFaults(h2d_delay_ms=3)
    on = rounds(engine, prompts)
    for a, b in zip(off, on):
        assert_same(a, b)
    stats = engine.stats()
    assert stats["hicache_loads"] > 0 and stats["num_kv_checksum_failures"] == 0
    assert stats["kv_checksum_slots_mismatched"] == 0
