"""The kv_corrupt fault point on the real runner (ModelRunner.corrupt_kv): the damage reaches the
next step (the torch backend's DecodeMirror copy is dropped), only the hit request changes,
for noise, swap and stale, in fp32 and FP8 KV, and the pages stay accounted for."""
from __future__ import annotations

import pytest

from radixserve.sampling_params import SamplingParams
from tests.model.test_parity import faults_of, make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)


def generate(engine, prompts, arm=None) -> dict[str, list[tuple[int, float]]]:
    """(token, logprob) per generated position of each request (the tiny random model's greedy
    tokens often sit in a loop that survives damage; its logprobs do not)."""
    if arm is not None:
        faults_of(engine).arm_kv_corrupt(**arm)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[tuple[int, float]]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [(t.token_id, t.logprob) for t in out.new_logprobs]
        engine.check_invariants()
    return tokens


@pytest.mark.parametrize("mode,kv_dtype", [("noise", "auto"), ("swap", "auto"), ("stale", "auto"),
                                           ("noise", "fp8_e4m3")])
def test_corruption_changes_the_hit_request_from_the_next_step_on(tiny_llama_dir, mode, kv_dtype):
    prompts = [[(13 * i + 7 * j) % 200 + 3 for j in range(40 + 9 * i)] for i in range(3)]
    cfg = {"disable_radix_cache": True, "kv_cache_dtype": kv_dtype}
    clean = generate(make_engine(tiny_llama_dir, **cfg), prompts)
    engine = make_engine(tiny_llama_dir, faults=True, **cfg)
    hurt = generate(engine, prompts, {"mode": mode, "fraction": 1.0, "after_tokens": 4, "seed": 5})
    (victim, at), = faults_of(engine).kv_corrupt_hits
    assert hurt[victim][:at] == clean[victim][:at]
    assert all(h != c for h, c in zip(hurt[victim][at:], clean[victim][at:]))
    assert all(hurt[r] == clean[r] for r in hurt if r != victim)
    assert engine.kv.pool.num_free == engine.kv.num_pages


def test_a_self_draft_stops_agreeing_with_a_corrupted_target(tmp_path):
    """The self-draft keeps KV of its own, which the fault does not touch: after the target's
    KV is overwritten, the target no longer samples what the draft (here as deep as the target,
    so otherwise always right) proposes. Acceptance drops for the hit request only."""
    import random

    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tmp_path, tie_word_embeddings=False, seed=3)
    engine = make_engine(model, faults=True, disable_radix_cache=True, speculative_algorithm="draft",
                         speculative_draft_layers=2)
    faults_of(engine).arm_kv_corrupt("noise", fraction=1.0, after_tokens=8, seed=2)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [rng.randrange(3, 512) for _ in range(50 + 20 * i)], params)
    spec = {}
    while engine.has_unfinished():
        for out in engine.step():
            spec[out.request_id] = out.spec
        engine.check_invariants()
    (victim, _), = faults_of(engine).kv_corrupt_hits
    assert spec[victim].accept_rate < 0.8
    assert all(s.accept_rate >= 0.95 for r, s in spec.items() if r != victim)
