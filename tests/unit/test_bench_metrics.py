"""Bench metric math against hand-computed fixtures (SGLang bench_serving definitions)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve.bench.metrics import (RequestResult, Slo, compute_metrics, max_concurrent_requests,
                                      max_output_tokens_per_s, stats_ms, tpot_s)


def req(start, ttft, itl, prompt_len=10, output_len=None, success=True, prompt_tokens=None, cached=None):
    """A request whose chunks each carry one token; latency = ttft + sum(itl)."""
    return RequestResult(prompt_len=prompt_len,
                         output_len=len(itl) + 1 if output_len is None else output_len,
                         success=success, start_s=start, ttft_s=ttft, latency_s=ttft + sum(itl),
                         itl_s=list(itl), prompt_tokens=prompt_tokens, cached_tokens=cached)


# Two good requests and one failure over a 4 s run.
#   A: start 0.0, TTFT 0.5, chunks at +0.5, 1.0, 1.5, 2.5 -> 4 tokens, latency 2.5
#   B: start 1.0, TTFT 1.0, chunks at +1.0, 1.2           -> 2 tokens, latency 1.2
RESULTS = [req(0.0, 0.5, [0.5, 0.5, 1.0], prompt_len=100, prompt_tokens=101, cached=64),
           req(1.0, 1.0, [0.2], prompt_len=50, prompt_tokens=51, cached=0),
           RequestResult(prompt_len=70, success=False, error="boom")]


def test_counts_and_throughputs():
    m = compute_metrics(RESULTS, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 150          # failed requests' prompts do not count
    assert m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["input_throughput"] == pytest.approx(37.5)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_throughput"] == pytest.approx(39.0)


def test_ttft_tpot_itl_e2e():
    m = compute_metrics(RESULTS, duration_s=4.0)
    assert m["mean_ttft_ms"] == pytest.approx(750.0)
    assert m["median_ttft_ms"] == pytest.approx(750.0)
    assert m["std_ttft_ms"] == pytest.approx(250.0)          # population std
    # TPOT excludes the first token: A (2.5-0.5)/(4-1) = 0.6667 s, B (1.2-1.0)/(2-1) = 0.2 s
    assert m["mean_tpot_ms"] == pytest.approx((2000 / 3 + 200) / 2)
    # ITL pooled over all gaps (0.5, 0.5, 1.0, 0.2), not averaged per request
    assert m["mean_itl_ms"] == pytest.approx(550.0)
    assert m["median_itl_ms"] == pytest.approx(500.0)
    assert m["max_itl_ms"] == pytest.approx(1000.0)
    # np.percentile linear interpolation: sorted (200, 500, 500, 1000), p95 at rank 2.85
    assert m["p95_itl_ms"] == pytest.approx(500 + 0.85 * 500)
    assert m["mean_e2e_latency_ms"] == pytest.approx(1850.0)
    assert m["p90_e2e_latency_ms"] == pytest.approx(1200 + 0.9 * 1300)


def test_tpot_needs_two_tokens():
    assert tpot_s(req(0, 0.3, [], output_len=1)) is None
    one_token = [req(0, 0.3, [], output_len=1)]
    assert compute_metrics(one_token, 1.0)["mean_tpot_ms"] == 0.0


def test_tpot_uses_server_output_len_not_chunks():
    # 3 chunks but the server reported 5 tokens (several tokens per chunk): (1.0 - 0.2) / 4
    r = req(0, 0.2, [0.4, 0.4], output_len=5)
    assert tpot_s(r) == pytest.approx(0.2)


def test_littles_law_concurrency_and_peak():
    m = compute_metrics(RESULTS, duration_s=4.0)
    assert m["concurrency"] == pytest.approx((2.5 + 1.2) / 4.0)
    # A in flight [0, 2.5), B [1.0, 2.2): overlap -> 2
    assert max_concurrent_requests(RESULTS[:2]) == 2
    back_to_back = [req(0, 0.5, [0.5]), req(1.0, 0.5, [0.5])]  # ends exactly when the next starts
    assert max_concurrent_requests(back_to_back) == 1


def test_max_output_tokens_per_s_buckets():
    # token times: A 0.5, 1.0, 1.5, 2.5; B 2.0, 2.2 -> buckets [0,1):1 [1,2):2 [2,3):3
    assert max_output_tokens_per_s(RESULTS[:2], t0=0.0) == 3
    assert compute_metrics(RESULTS, 4.0)["max_output_tokens_per_s"] == 3


def test_percentiles_empty_and_single():
    assert stats_ms([], "x", (99,)) == {"mean_x_ms": 0.0, "median_x_ms": 0.0, "std_x_ms": 0.0, "p99_x_ms": 0.0}
    assert stats_ms([0.1, 0.2, 0.3, 0.4], "x", (50, 99))["p99_x_ms"] == pytest.approx(397.0)


def test_cache_hit_rate_from_usage():
    m = compute_metrics(RESULTS, 4.0)
    assert m["cache_hit_rate"] == pytest.approx(64 / 152)
    no_usage = [req(0, 0.1, [0.1])]
    assert compute_metrics(no_usage, 1.0)["cache_hit_rate"] is None


def test_speculative_acceptance_from_usage():
    import dataclasses
    a = dataclasses.replace(req(0.0, 0.5, [0.5]), spec_verify_steps=4, spec_draft_tokens=12,
                            spec_accepted_tokens=6)     # 2.5 tokens per step
    b = dataclasses.replace(req(0.0, 0.5, [0.5]), spec_verify_steps=1, spec_draft_tokens=4,
                            spec_accepted_tokens=0)     # 1.0
    m = compute_metrics([a, b, req(0.0, 0.5, [0.5])], 1.0)
    assert m["spec_requests"] == 2
    assert m["spec_accept_length"] == pytest.approx((6 + 5) / 5)
    assert m["spec_accept_rate"] == pytest.approx(6 / 16)
    assert m["median_spec_accept_length"] == pytest.approx(2.5)
    assert compute_metrics(RESULTS, 4.0)["spec_accept_length"] is None


def test_goodput():
    slo = Slo.parse("ttft_ms=800,tpot_ms=500")
    m = compute_metrics(RESULTS, 4.0, slo=slo)
    # A: ttft 500 ok, tpot 667 > 500 -> bad; B: ttft 1000 > 800 -> bad; failed -> bad
    assert m["request_goodput"] == 0.0
    m = compute_metrics(RESULTS, 4.0, slo=Slo.parse("ttft_ms=1000,tpot_ms=700"))
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        Slo.parse("ttft=5")


def test_bench_imports_without_torch():
    code = ("import sys; import radixserve.bench.cli, radixserve.bench.client, radixserve.bench.report, "
            "radixserve.bench.datasets, radixserve.bench.sources, radixserve.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hit_rate_from_prometheus_counters():
    from radixserve.bench.client import counter_hit_rate, parse_cache_counters
    page = ('# HELP radixserve:prompt_tokens_total Prompt tokens.\n'
            'radixserve:prompt_tokens_total{model_name="m"} 1000.0\n'
            'radixserve:cached_tokens_total{model_name="m"} 600.0\n'
            'radixserve:cached_tokens_created{model_name="m"} 1.7e9\n'
            'vllm:prompt_tokens_total 5\n')
    assert parse_cache_counters(page) == (1000.0, 600.0)
    assert parse_cache_counters("vllm:prompt_tokens_total 5\n") is None
    assert counter_hit_rate((1000.0, 600.0), (1400.0, 900.0)) == pytest.approx(0.75)
    assert counter_hit_rate(None, (1.0, 1.0)) is None
