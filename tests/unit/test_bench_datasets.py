"""Bench dataset generators: exact lengths, reuse ratio against each dataset's theory, trace timing."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from radixserve.bench import datasets, sources
from radixserve.bench.workload import (WordSource, Workload, poisson_offsets, range_lengths,
                                       reuse_ratio, schedule)


@pytest.fixture(scope="module")
def hf(default_gguf):
    from radixserve.bench.cli import load_tokenizer
    return load_tokenizer(str(default_gguf))


@pytest.fixture(scope="module")
def src(hf):
    return WordSource(hf)


def token_ids(hf, workload: Workload) -> list[list[int]]:
    return [hf.encode(r.prompt, add_special_tokens=False) for r in workload.requests]


def test_word_source_exact_lengths(src):
    rng = random.Random(3)
    for n in (1, 7, 300):
        assert src.count(src.text(rng, n)) == n


def test_range_lengths_sglang_meaning():
    rng = random.Random(0)
    fixed = range_lengths(rng, 100, 1.0, 50)
    assert set(fixed) == {100}
    wide = range_lengths(rng, 100, 0.0, 2000)
    assert min(wide) >= 1 and max(wide) <= 100
    assert 45 < np.mean(wide) < 56                 # r = 0: uniform in [1, L], mean ~L/2
    half = range_lengths(rng, 100, 0.5, 2000)
    assert min(half) >= 50


def test_random_dataset(hf, src):
    w = datasets.random_dataset(src, 20, 64, 16, 0.5, seed=1)
    assert len(w.requests) == 20
    for r, ids in zip(w.requests, token_ids(hf, w)):
        assert r.prompt_len == len(ids) and 32 <= r.prompt_len <= 64
        assert 8 <= r.output_len <= 16
    assert "sglang" in w.info["range_ratio_semantics"]
    again = datasets.random_dataset(src, 20, 64, 16, 0.5, seed=1)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]


def test_shared_prefix_reuse_matches_theory(hf, src):
    w = datasets.shared_prefix_dataset(src, num_groups=4, prompts_per_group=6, system_prompt_len=200,
                                       question_len=30, output_len=8, seed=2)
    ids = token_ids(hf, w)
    assert len(ids) == 24
    assert all(r.prompt_len == len(i) for r, i in zip(w.requests, ids))
    theory = w.info["theory_reuse"]
    assert theory == pytest.approx(5 / 6 * (200 + 3) / (200 + 3 + 30 + 3), rel=0.02)
    assert reuse_ratio(ids) == pytest.approx(theory, abs=0.005)


def test_multi_turn_reuse_matches_theory(hf, src):
    w = datasets.multi_turn_dataset(src, num_clients=3, num_rounds=4, system_prompt_len=20,
                                    user_len=25, output_len=15, seed=3)
    assert [len(s.requests) for s in w.sessions] == [4, 4, 4]
    for s in w.sessions:  # round k's prompt is round k-1's plus the answer and a new user turn
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert cur.prompt.startswith(prev.prompt) and cur.prompt_len > prev.prompt_len
            assert len(cur.messages) == len(prev.messages) + 2
    assert reuse_ratio(token_ids(hf, w)) == pytest.approx(w.info["theory_reuse"], abs=0.005)
    assert w.info["theory_reuse"] > 0.5


def test_agent_reuse_matches_theory(hf, src):
    w = datasets.agent_dataset(src, num_sessions=3, num_turns=4, context_len=400, task_len=20,
                               tool_len=50, output_len=20, seed=4)
    ids = token_ids(hf, w)
    assert reuse_ratio(ids) == pytest.approx(w.info["theory_reuse"], abs=0.005)
    assert w.info["theory_reuse"] > 0.8  # high reuse: shared repository context plus growing turns
    assert all(s.requests[0].messages[0] == w.sessions[0].requests[0].messages[0] for s in w.sessions)


def test_agent_sessions_spread_over_repositories(hf, src):
    w = datasets.agent_dataset(src, num_sessions=5, num_turns=3, context_len=300, task_len=20,
                               tool_len=40, output_len=10, seed=5, num_contexts=2)
    assert reuse_ratio(token_ids(hf, w)) == pytest.approx(w.info["theory_reuse"], abs=0.005)
    heads = [s.requests[0].messages[0]["content"] for s in w.sessions]
    assert heads[0] != heads[1] and heads[0] == heads[2] == heads[4] and heads[1] == heads[3]
    one = datasets.agent_dataset(src, num_sessions=5, num_turns=3, context_len=300, task_len=20,
                                 tool_len=40, output_len=10, seed=5)
    assert w.info["theory_reuse"] < one.info["theory_reuse"]   # a second repository misses once more
    with pytest.raises(ValueError):
        datasets.agent_dataset(src, 2, 3, 300, 20, 40, 10, 5, num_contexts=3)


def test_reuse_ratio_page_aligned():
    a = list(range(40))
    b = list(range(35)) + [99] * 5
    # b shares 35 tokens with a; page 16 -> 32 reused of 80 total
    assert reuse_ratio([a, b]) == pytest.approx(35 / 80)
    assert reuse_ratio([a, b], page_size=16) == pytest.approx(32 / 80)
    assert reuse_ratio([a, a]) == pytest.approx(39 / 80)  # at least one token is computed


def test_sharegpt_file(tmp_path, hf, src):
    data = [{"conversations": [{"from": "human", "value": "What is the capital of France?"},
                               {"from": "gpt", "value": "The capital of France is Paris."}]},
            {"conversations": [{"from": "human", "value": "hi"}]},          # one turn: dropped
            {"conversations": [{"from": "human", "value": "Tell me a long story about cats."},
                               {"from": "gpt", "value": "Once upon a time there was a cat."}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    w = sources.sharegpt_dataset(str(path), src, num_prompts=10, seed=0)
    assert len(w.requests) == 2
    for r in w.requests:
        assert r.prompt_len == len(hf.encode(r.prompt, add_special_tokens=False))
    by_prompt = {r.prompt: r for r in w.requests}
    answer = "The capital of France is Paris."
    assert by_prompt["What is the capital of France?"].output_len == src.count(answer)
    fixed = sources.sharegpt_dataset(str(path), src, num_prompts=10, seed=0, output_len=7)
    assert {r.output_len for r in fixed.requests} == {7}


def write_trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_timing_and_hash_reuse(tmp_path, hf, src):
    rows = [{"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 30, "output_length": 6, "hash_ids": [1, 2]},
            {"timestamp": 4000, "input_length": 20, "output_length": 7, "hash_ids": [9, 10]}]
    path = write_trace(tmp_path, rows)
    w = sources.trace_dataset(path, src, time_scale=2.0, block_size=16)
    assert [s.arrival_s for s in w.sessions] == pytest.approx([0.0, 1.0, 6.0])  # ms -> s, x2
    assert [r.prompt_len for r in w.requests] == [40, 30, 20]
    assert [r.output_len for r in w.requests] == [5, 6, 7]
    ids = token_ids(hf, w)
    assert ids[1][:30] == ids[0][:30]                # shared hash ids 1, 2 -> shared first 30 tokens
    assert ids[2][:16] != ids[0][:16]
    assert w.info["theory_reuse"] == pytest.approx(29 / 90)   # capped at len - 1
    # schedule keeps the trace's own offsets whatever the request rate
    assert schedule(w, request_rate=100.0, seed=0) == pytest.approx([0.0, 1.0, 6.0])
    fast = sources.trace_dataset(path, src, time_scale=0.5, block_size=16)
    assert [s.arrival_s for s in fast.sessions] == pytest.approx([0.0, 0.25, 1.5])


def test_trace_plain_lengths(tmp_path, src):
    path = write_trace(tmp_path, [{"timestamp": 0.0, "input_len": 12, "output_len": 3},
                                  {"timestamp": 2.5, "input_len": 12, "output_len": 3}])
    w = sources.trace_dataset(path, src, time_unit_s=1.0)
    assert [s.arrival_s for s in w.sessions] == [0.0, 2.5]
    assert w.requests[0].prompt != w.requests[1].prompt


def test_poisson_offsets():
    assert poisson_offsets(5, float("inf"), np.random.default_rng(0)) == [0.0] * 5
    offsets = poisson_offsets(4000, 10.0, np.random.default_rng(0))
    assert offsets == sorted(offsets) and offsets[0] > 0
    gaps = np.diff([0.0, *offsets])
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert offsets == poisson_offsets(4000, 10.0, np.random.default_rng(0))  # seeded
