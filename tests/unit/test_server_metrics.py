"""ServerMetrics without a server: names, labels, counters from an engine snapshot, timers."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from radixserve.server.metrics import RequestTimer, ServerMetrics

STATS = {"num_running": 2, "num_waiting": 1, "token_usage": 0.25, "cache_hit_rate": 0.5,
         "num_prompt_tokens": 100, "num_generated_tokens": 40, "num_cached_tokens": 50,
         "num_finished_requests": 3, "num_aborted_requests": 2, "num_preemptions": 1,
         "spec_num_verify_steps": 10, "spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 12}


def samples(text: str) -> dict[str, tuple[dict, float]]:
    return {s.name: (s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.name.endswith("_bucket")}


def test_engine_snapshot_becomes_gauges_and_counters():
    m = ServerMetrics("m1")
    got = samples(m.render(STATS).decode())
    assert got["radixserve:num_running_reqs"] == ({"model_name": "m1"}, 2)
    assert got["radixserve:num_queue_reqs"][1] == 1
    assert got["radixserve:token_usage"][1] == 0.25
    assert got["radixserve:prompt_tokens_total"][1] == 100
    assert got["radixserve:cached_tokens_total"][1] == 50
    assert got["radixserve:num_requests_total"][1] == 5   # finished + aborted
    assert got["radixserve:num_aborted_requests_total"][1] == 2
    assert got["radixserve:num_preempted_reqs_total"][1] == 1
    assert got["radixserve:spec_verify_steps_total"][1] == 10
    assert got["radixserve:spec_draft_tokens_total"][1] == 30
    assert got["radixserve:spec_accepted_tokens_total"][1] == 12


def test_compiled_decode_graphs_and_recompiles():
    """--compile's counts come from the runner's info (C63); eager runners show 0."""
    m = ServerMetrics("m1")
    got = samples(m.render(STATS).decode())
    assert got["radixserve:compile_graphs"][1] == 0 and got["radixserve:compile_recompiles_total"][1] == 0
    compiled = {**STATS, "runner": {"compile": {"graphs": 4, "recompiles": 1}}}
    got = samples(m.render(compiled).decode())
    assert got["radixserve:compile_graphs"][1] == 4 and got["radixserve:compile_recompiles_total"][1] == 1


def test_no_snapshot_keeps_the_last_one_and_histograms():
    m = ServerMetrics("m1")
    assert "radixserve:num_running_reqs" not in samples(m.render(None).decode())
    m.render(STATS)
    got = samples(m.render(None).decode())
    assert got["radixserve:generation_tokens_total"][1] == 40
    assert got["radixserve:e2e_request_latency_seconds_count"][1] == 0


def test_gen_throughput_is_positive_after_generation():
    m = ServerMetrics("m1")
    m.render(STATS)
    got = samples(m.render({**STATS, "num_generated_tokens": 140}).decode())
    assert got["radixserve:gen_throughput"][1] > 0


def test_request_timer_counts_once_per_token_delta():
    m = ServerMetrics("m1")
    t = RequestTimer(m, start_s=0.0)
    t.on_output(0, None)          # prompt logprobs only: no token yet
    t.on_output(1, 0.01)          # first token: TTFT and queue time
    t.on_output(2, 0.01)          # one ITL sample for a 2-token delta
    t.on_output(1, 0.01)
    t.on_end()
    got = samples(m.render(None).decode())
    assert got["radixserve:time_to_first_token_seconds_count"][1] == 1
    assert got["radixserve:queue_time_seconds_count"][1] == 1
    assert got["radixserve:inter_token_latency_seconds_count"][1] == 2
    assert got["radixserve:e2e_request_latency_seconds_count"][1] == 1
