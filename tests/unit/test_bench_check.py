"""bench --save-output / --check-output (bench/check.py): reading tokens and top-2 gaps from
streamed chunks, and judging each output identical, tie, corrupted, guard abort or failed."""
from __future__ import annotations

import json

import pytest

from radixserve.bench import check
from radixserve.bench.metrics import RequestResult


def test_tokens_and_gaps_from_completion_and_chat_chunks():
    completion = {"choices": [{"text": "ab", "logprobs": {
        "tokens": ["a", "b"], "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"a": -0.1, "c": -2.1}, {"b": -0.5}]}}]}
    assert check.chunk_tokens(completion, "completions") == [("a", pytest.approx(2.0)), ("b", None)]
    chat = {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [
        {"token": "a", "logprob": -0.2, "top_logprobs": [{"token": "z", "logprob": -1.2},
                                                          {"token": "a", "logprob": -0.2}]}]}}]}
    assert check.chunk_tokens(chat, "chat") == [("a", pytest.approx(1.0))]
    assert check.chunk_tokens({"choices": [], "usage": {}}, "chat") == []
    assert check.logprob_fields("chat") == {"logprobs": True, "top_logprobs": 2}
    assert check.logprob_fields("completions") == {"logprobs": 2}


def result(index, tokens, success=True, error=""):
    return RequestResult(prompt_len=1, success=success, error=error, index=index,
                         tokens=list(tokens), top2_gaps=[1.0] * len(tokens))


def test_compare_judges_each_output():
    ref = {i: {"index": i, "tokens": list("abcd"), "gaps": [2.0, 0.0005, 2.0, 2.0]}
           for i in range(6)}
    results = [result(0, "abcd"),                       # identical
               result(1, "axcd"),                       # first difference at a tie (gap 5e-4)
               result(2, "abxd"),                       # corrupted at position 2
               result(3, "", False, "{'type': 'output_anomaly'}"),
               result(4, "", False, "HTTP 500"),
               result(9, "abcd")]                       # no reference
    report = check.compare(ref, results)
    assert {k: report[k] for k in ("identical", "tie", "corrupted", "guard_abort", "failed",
                                   "no_reference", "compared")} == \
        {"identical": 1, "tie": 1, "corrupted": 1, "guard_abort": 1, "failed": 1,
         "no_reference": 1, "compared": 4}
    assert report["corrupted_per_10k"] == 2500 and report["guard_aborts_per_10k"] == 2500
    assert report["first_corrupted"] == [{"index": 2, "position": 2, "top2_gap": 2.0,
                                          "expected": "c", "got": "x"}]
    shorter = check.compare(ref, [result(0, "ab")])     # ends early where the reference goes on
    assert shorter["corrupted"] == 1 and shorter["first_corrupted"][0]["position"] == 2
    assert "1 corrupted" in check.summary_line(shorter)


def test_merge_sums_runs_and_recomputes_rates():
    ref = {i: {"index": i, "tokens": list("ab"), "gaps": [2.0, 2.0]} for i in range(2)}
    clean = check.compare(ref, [result(0, "ab"), result(1, "ab")])
    bad = check.compare(ref, [result(0, "ab"), result(1, "ax")])
    merged = check.merge([clean, bad, clean])
    assert merged["compared"] == 6 and merged["identical"] == 5 and merged["corrupted"] == 1
    assert merged["corrupted_per_10k"] == pytest.approx(1e4 / 6)
    assert merged["first_corrupted"] == bad["first_corrupted"]
    with pytest.raises(ValueError):
        check.merge([])
    with pytest.raises(ValueError):
        check.merge([clean, check.compare(ref, [result(0, "ab")], tie_gap=0.1)])


def test_save_then_load_round_trips_and_rejects_other_files(tmp_path):
    path = tmp_path / "ref.jsonl"
    check.save(str(path), [result(1, "xy"), result(0, "ab")])
    loaded = check.load(str(path))
    assert sorted(loaded) == [0, 1] and loaded[1]["tokens"] == ["x", "y"]
    assert check.compare(loaded, [result(0, "ab"), result(1, "xy")])["identical"] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no tokens"}) + "\n")
    with pytest.raises(ValueError, match="save-output"):
        check.load(str(bad))
