"""`radixserve bench` end to end against a real radixserve server (tiny model, page size 16)."""
from __future__ import annotations

import json

import pytest

from radixserve.bench.cli import load_tokenizer, main
from radixserve.bench.datasets import shared_prefix_dataset
from radixserve.bench.workload import WordSource, reuse_ratio
from tests.api.conftest import API_KEY

SGLANG_KEYS = [
    "tag", "backend", "dataset_name", "request_rate", "max_concurrency", "sharegpt_output_len",
    "random_input_len", "random_output_len", "random_range_ratio", "duration", "completed",
    "total_input_tokens", "total_output_tokens", "total_output_tokens_retokenized",
    "request_throughput", "input_throughput", "output_throughput", "total_throughput",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "std_e2e_latency_ms", "p90_e2e_latency_ms",
    "p99_e2e_latency_ms", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "std_itl_ms", "p95_itl_ms", "p99_itl_ms", "concurrency", "max_output_tokens_per_s",
    "max_concurrent_requests"]
GSP = dict(num_groups=2, prompts_per_group=4, system_prompt_len=128, question_len=16, output_len=4)


def bench(tiny_server, out, *extra):
    return main(["--base-url", tiny_server.base_url, "--api-key", API_KEY, "--tokenizer",
                 str(tiny_server_tokenizer_path(tiny_server)), "--output-file", str(out),
                 "--disable-progress", "--ignore-eos", "--flush-cache", "--seed", "5", *extra])


def tiny_server_tokenizer_path(tiny_server):
    return tiny_server.get("/server_info").json()["model_path"]


def test_shared_prefix_run_reports_hit_rate(tiny_server, tmp_path):
    out = tmp_path / "run.jsonl"
    code = bench(tiny_server, out, "--dataset-name", "shared-prefix", "--max-concurrency", "1",
                 "--num-groups", "2", "--prompts-per-group", "4", "--system-prompt-len", "128",
                 "--question-len", "16", "--output-len", "4", "--slo", "ttft_ms=60000,tpot_ms=60000",
                 "--tag", "e2e")
    assert code == 0
    record = json.loads(out.read_text().splitlines()[-1])
    assert [k for k in SGLANG_KEYS if k not in record] == []
    assert record["completed"] == 8 and record["failed"] == 0
    assert record["tag"] == "e2e" and record["ignore_eos"] is True
    assert record["total_output_tokens"] == 8 * 4                 # ignore_eos: exact lengths
    assert record["request_goodput"] > 0 and record["slo_attainment"] == 1.0
    assert record["concurrency"] <= 1.0 + 1e-6                    # one at a time (Little's law)
    # Theory with the server's page size: each group's first prompt misses, the others reuse the
    # system prompt rounded down to whole 16-token pages.
    hf = load_tokenizer(tiny_server_tokenizer_path(tiny_server))
    workload = shared_prefix_dataset(WordSource(hf), seed=5, **GSP)
    ids = [hf.encode(r.prompt) for r in workload.requests]
    expected = reuse_ratio(ids, page_size=16)
    assert expected == pytest.approx(2 * 3 * 128 / sum(map(len, ids)), rel=0.02)
    assert record["cache_hit_rate"] == pytest.approx(expected, abs=0.03)


def test_multi_turn_chat_run(tiny_server, tmp_path):
    out = tmp_path / "chat.jsonl"
    code = bench(tiny_server, out, "--dataset-name", "multi-turn", "--backend", "chat",
                 "--num-clients", "2", "--num-rounds", "3", "--user-len", "20", "--output-len", "4",
                 "--request-rate", "50")
    assert code == 0
    record = json.loads(out.read_text())
    assert record["completed"] == 6 and record["failed"] == 0
    assert record["backend"] == "chat" and record["dataset_name"] == "multi-turn"
    assert record["cache_hit_rate"] > 0.3   # later rounds reuse the conversation so far
