"""The kv_corrupt fault point (chaos/kv_corrupt.py) over the fake runner: which request and
pages it hits, that only that request's output changes, that pages stay accounted for, and
what it refuses. Its effect on a real model and on the detectors: test_kv_corrupt_model.py and
benchmarks/spec_anomaly.py."""
from __future__ import annotations

import pytest

from radixserve.chaos.engine_faults import EngineFaults
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeRunner

VOCAB = 500
GREEDY = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": [(7 * i + j) % 97 + 3 for j in range(6)] * 3 for i in range(4)}


class RecordingRunner(FakeRunner):
    """The fake runner, remembering every corrupt_kv call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.corruptions: list[tuple[list[int], str, list[int] | None]] = []

    def corrupt_kv(self, page_ids, mode, source_page_ids, seed):
        self.corruptions.append((list(page_ids), mode, source_page_ids))
        super().corrupt_kv(page_ids, mode, source_page_ids, seed)


def make_engine(runner=None) -> Engine:
    """The test engine with fault injection attached (faults_of)."""
    runner = runner or RecordingRunner(256, 4, VOCAB, 4096, copy_period=6)
    return Engine(EngineConfig(page_size=4, chunked_prefill_size=64, disable_radix_cache=True), runner,
                  hooks=[EngineFaults()])


def faults_of(engine: Engine) -> EngineFaults:
    return engine.hooks.hooks[0]


def run(engine: Engine, arm=None, arm_at_step: int = 0) -> tuple[dict, dict]:
    """Generate PROMPTS at once; `arm` (kwargs of arm_kv_corrupt) at step `arm_at_step`.
    Returns tokens and the outputs of each request; checks page invariants after every step."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    outs: dict[str, list] = {rid: [] for rid in PROMPTS}
    step = 0
    while engine.has_unfinished():
        if arm is not None and step == arm_at_step:
            faults_of(engine).arm_kv_corrupt(**arm)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            outs[out.request_id].append(out)
        engine.check_invariants()
        step += 1
    return tokens, outs


@pytest.mark.parametrize("mode", ["noise", "swap", "stale"])
def test_the_fault_hits_one_request_past_after_tokens_and_only_its_output_changes(mode):
    clean, _ = run(make_engine())
    engine = make_engine()
    hurt, _ = run(engine, {"mode": mode, "fraction": 0.5, "after_tokens": 5, "count": 1, "seed": 3})
    (victim, at), = faults_of(engine).kv_corrupt_hits
    assert at >= 5
    (pages, got_mode, source), = engine.runner.corruptions
    assert got_mode == mode and engine.stats()["num_kv_corruptions"] == 1
    if mode != "noise":
        assert source is not None and len(source) == len(pages) and not set(source) & set(pages)
    assert hurt[victim][:at] == clean[victim][:at] and hurt[victim] != clean[victim]
    assert {rid: t for rid, t in hurt.items() if rid != victim} == \
        {rid: t for rid, t in clean.items() if rid != victim}


def test_count_requests_are_hit_once_each():
    engine = make_engine()
    run(engine, {"mode": "noise", "fraction": 1.0, "after_tokens": 0, "count": 3})
    hit = [rid for rid, _ in faults_of(engine).kv_corrupt_hits]
    assert len(hit) == len(set(hit)) == 3 and len(engine.runner.corruptions) == 3


def test_disarm_stops_it_and_bad_arguments_or_runners_are_refused():
    engine = make_engine()
    faults_of(engine).arm_kv_corrupt("noise", after_tokens=10_000)
    faults_of(engine).disarm_kv_corrupt()
    run(engine)
    assert engine.runner.corruptions == [] and faults_of(engine).kv_corrupt_hits == []
    for kwargs in ({"mode": "flip"}, {"mode": "noise", "fraction": 0.0},
                   {"mode": "noise", "fraction": 1.5}, {"mode": "noise", "count": 0},
                   {"mode": "noise", "after_tokens": -1}):
        with pytest.raises(InvalidRequest):
            faults_of(engine).arm_kv_corrupt(**kwargs)

    class NoCorruption(FakeRunner):
        corrupt_kv = None

    with pytest.raises(InvalidRequest, match="cannot corrupt"):
        faults_of(make_engine(runner=NoCorruption(64, 4, VOCAB))).arm_kv_corrupt("noise")


def test_stale_copies_the_most_recently_freed_pages_and_waits_for_enough_of_them():
    from radixserve.chaos.kv_corrupt import KVCorruptFault
    from radixserve.engine.request import Request

    victim = Request("v", list(range(16)), GREEDY, seed=0, max_tokens=8, arrival_s=0.0)
    victim.page_ids, victim.num_computed_tokens, victim.output_ids = [4, 5, 6, 7], 16, [1, 2]
    fault = KVCorruptFault.armed("stale", fraction=0.5, after_tokens=1, count=1, duration_s=None, seed=0)
    assert fault.next([victim], 4, 0.0, free_page_ids=[9]) is None and fault.hit == []
    hit = fault.next([victim], 4, 0.0, free_page_ids=[9, 12, 3])
    assert hit.mode == "stale" and len(hit.page_ids) == 2 and set(hit.page_ids) <= {4, 5, 6, 7}
    assert hit.source_page_ids == [12, 3] and fault.hit == [("v", 2)] and fault.is_spent
