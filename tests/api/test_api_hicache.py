"""The host KV tier through a real tiny-model worker: per-tier counters from start-up (C32), a sentinel pushed off the device comes back from host and says so in usage, the fault points (hicache.h2d.layer fail and delay, hicache.d2h, hicache.host_alloc) keep outputs right (C30, C31), and no page leaks in either tier (/debug/pages' invariant covers the host pool)."""
from __future__ import annotations

import json
import random

import pytest

from tests.api.conftest import API_KEY, TINY_CONTEXT, start_tiny_server

PAGE = 16


@pytest.fixture(scope="module")
def server(request):
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT),
                                         "--max-total-tokens", str(24 * PAGE), "--page-size", str(PAGE),
                                         "--enable-hierarchical-cache", "--hicache-ratio", "4",
                                         "--enable-debug-endpoints", "--enable-fault-injection"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def complete(server, prompt: list[int]) -> dict:
    r = server.post("/v1/completions", json={"model": server.model, "prompt": prompt,
                                             "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def push_off_device(server, rng, n=3):
    for _ in range(n):
        complete(server, [rng.randrange(100, 40000) for _ in range(8 * PAGE)])


def inject(server, **body) -> None:
    r = server.post("/admin/fault", json=body)
    assert r.status_code == 200, r.text


def test_counters_exist_at_zero_from_start_up(server):
    m = server.metrics()
    for name in ("cached_tokens_host_total", "cached_tokens_device_total", "hicache_loads_total",
                 "hicache_failed_loads_total", "hicache_load_bytes_total", "hicache_backup_pages_total"):
        assert m["radixserve:" + name] == 0, name
    assert m["radixserve:hicache_host_pages"] == 4 * 24
    info = server.stats()
    assert info["hicache_write_policy"] == "write_through" and info["hicache_host_used_pages"] == 0


def test_a_sentinel_pushed_off_the_device_hits_host_and_usage_says_so(server):
    """C32."""
    rng = random.Random(1)
    sentinel = [rng.randrange(100, 40000) for _ in range(8 * PAGE + 3)]
    first = complete(server, sentinel)
    push_off_device(server, rng)
    before = server.metrics()
    again = complete(server, sentinel)
    after = server.metrics()
    details = again["usage"]["prompt_tokens_details"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert details["cached_tokens"] >= len(sentinel) - PAGE - 1
    assert details["cached_tokens_host"] == details["cached_tokens"]
    host = "radixserve:cached_tokens_host_total"
    assert after[host] - before[host] == details["cached_tokens"]
    assert after["radixserve:hicache_loads_total"] > before["radixserve:hicache_loads_total"]
    server.assert_no_leak()


def test_failed_and_slow_loads_never_change_an_output(server):
    """C30 over HTTP: a load that fails is recomputed (no hit reported), one whose layers land
    late is waited for; slow backups and refused host allocations change nothing either."""
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(6 * PAGE + 1)] for _ in range(2)]
    reference = [complete(server, p)["choices"][0]["text"] for p in prompts]
    for fault, expect_hit in (({"kind": "hicache.h2d.layer", "latency_ms": 0, "jitter_ms": 0,
                                "fail_fraction": 1.0}, False),
                              ({"kind": "hicache.h2d.layer", "latency_ms": 5, "jitter_ms": 5}, True)):
        push_off_device(server, rng)
        before = server.metrics()
        inject(server, **fault)
        inject(server, kind="hicache.d2h", latency_ms=5)
        inject(server, kind="hicache.host_alloc", fraction=0.5)
        outs = [complete(server, p) for p in prompts]
        server.http.delete("/admin/fault")
        after = server.metrics()
        assert [o["choices"][0]["text"] for o in outs] == reference
        failed = after["radixserve:hicache_failed_loads_total"] - before["radixserve:hicache_failed_loads_total"]
        host = [o["usage"]["prompt_tokens_details"]["cached_tokens_host"] for o in outs]
        if expect_hit:
            assert failed == 0 and all(h > 0 for h in host)
        else:
            assert failed > 0 and host == [0, 0]
    server.assert_no_leak()


def test_warm_start_from_the_disk_tier_and_from_warmup_prompts(request, tmp_path, default_tokenizer):
    """After a restart over the same --hicache-storage-dir the first request of a known prompt
    hits (from disk, through host); --warmup-prompts fills the cache before /health is 200."""
    rng = random.Random(3)
    saved = [rng.randrange(100, 40000) for _ in range(6 * PAGE + 1)]
    text = "Warm me up. " * 40
    warm = tmp_path / "warm.jsonl"
    warm.write_text('{"prompt": %s}\n{"messages": [{"role": "user", "content": "hello there"}]}\n'
                    % json.dumps(text))
    common = ["--context-length", str(TINY_CONTEXT), "--max-total-tokens", str(24 * PAGE),
              "--page-size", str(PAGE), "--enable-hierarchical-cache",
              "--hicache-storage-dir", str(tmp_path / "kv"), "--enable-debug-endpoints"]
    first = start_tiny_server(request, common)
    try:
        reference = complete(first, saved)["choices"][0]["text"]
    finally:
        first.stop()                      # graceful: pages still being saved reach the disk
    second = start_tiny_server(request, [*common, "--warmup-prompts", str(warm)])
    try:
        assert second.stats()["num_cached_pages"] > 0            # warmed before serving
        again = complete(second, saved)
        details = again["usage"]["prompt_tokens_details"]
        assert again["choices"][0]["text"] == reference
        assert details["cached_tokens"] >= len(saved) - PAGE - 1
        assert details["cached_tokens_host"] == details["cached_tokens"]
        assert second.stats()["hicache_disk_fetch_pages"] > 0
        r = second.post("/v1/completions", json={"model": second.model, "prompt": text,
                                                 "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        second.assert_no_leak()
    finally:
        second.stop()


@pytest.mark.parametrize("content,error", [(None, "No such file"), ("{oops\n", "not JSON"),
                                           ('{"prompt": 5}\n', "expected a string")])
def test_a_bad_warmup_file_stops_start_up_before_loading(tiny_model_dir, tmp_path, content, error):
    import subprocess
    import sys
    path = tmp_path / "warm.jsonl"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path",
                           str(tiny_model_dir), "--port", "0", "--warmup-prompts", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert error in proc.stderr and "Traceback" not in proc.stderr


def test_soak_scaled_down_finds_no_corrupted_output(server, tiny_server, tmp_path):
    """benchmarks/hicache.py's soak at 50 requests: multi-turn conversations through this
    small-pool tier server with every layer's load delayed U(0, 4) ms, each greedy output
    compared with the same request on the tier-off tiny server (bench --check-output URL)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hicache.py"
    spec = importlib.util.spec_from_file_location("hicache_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    server.http.post("/flush_cache")
    waves = bench.soak_waves(50, 4, wave_clients=5, system_len=100, user_len=20, output_len=8)
    assert len(waves) == 2
    report = bench.check_under_delays(server.base_url, [(w, tiny_server.base_url) for w in waves], 2.0, 2.0,
                                      tmp_path / "run.jsonl", api_key=API_KEY)
    assert report["compared"] >= 49, report
    assert report["corrupted"] == 0, report["first_corrupted"]
    assert report["hicache_loads"] > 0 and report["num_cached_tokens_host"] > 0, report
    server.assert_no_leak()
