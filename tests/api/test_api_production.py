"""Production serving over real servers on the tiny model: /metrics (C19), /abort_request, the
debug page view, disconnects mid-prefill and mid-stream that return pages (C06), 64 concurrent
streams with shared prefixes equal to sequential runs with no page leaked, shared-prefix idle
self-check (C03), preemption not counted as cache hits (C19), engine killed under load (C21)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import threading

import httpx
import pytest

from radixserve.http_common import poller_limits

from tests.api.conftest import start_tiny_server
from tests.api.test_api_lifecycle import wait_for

METRIC_NAMES = [
    "radixserve:num_running_reqs", "radixserve:num_queue_reqs", "radixserve:token_usage",
    "radixserve:cache_hit_rate", "radixserve:gen_throughput", "radixserve:prompt_tokens_total",
    "radixserve:generation_tokens_total", "radixserve:cached_tokens_total",
    "radixserve:num_requests_total", "radixserve:num_aborted_requests_total",
    "radixserve:num_preempted_reqs_total", "radixserve:time_to_first_token_seconds_count",
    "radixserve:inter_token_latency_seconds_count", "radixserve:e2e_request_latency_seconds_count",
    "radixserve:queue_time_seconds_count"]


def delta(after: dict, before: dict, name: str) -> float:
    return after["radixserve:" + name] - before["radixserve:" + name]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


# ---- metrics on the shared tiny server --------------------------------------------------------
def test_metrics_names_and_label(tiny_server):
    text = tiny_server.get("/metrics").text
    assert 'model_name="tiny"' in text
    values = tiny_server.metrics()
    assert set(METRIC_NAMES) <= set(values), sorted(set(METRIC_NAMES) - set(values))
    assert all(v >= 0 for v in values.values())


def test_metrics_count_one_request_exactly(tiny_server):
    prompt = ids(random.Random(1), 37)
    before = tiny_server.metrics()
    r = tiny_server.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                  "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    after = tiny_server.metrics()
    assert delta(after, before, "prompt_tokens_total") == 37
    assert delta(after, before, "generation_tokens_total") == 5
    assert delta(after, before, "num_requests_total") == 1
    assert delta(after, before, "num_aborted_requests_total") == 0
    assert delta(after, before, "cached_tokens_total") == r.json()["usage"][
        "prompt_tokens_details"]["cached_tokens"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        assert delta(after, before, hist + "_count") == 1, hist
    assert delta(after, before, "inter_token_latency_seconds_count") == 4
    assert after["radixserve:num_running_reqs"] == 0


def test_rejected_requests_count_nothing(tiny_server):
    before = tiny_server.metrics()
    r = tiny_server.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400
    after = tiny_server.metrics()
    for name in ("num_requests_total", "prompt_tokens_total", "e2e_request_latency_seconds_count"):
        assert delta(after, before, name) == 0, name


def test_debug_view_and_flush(tiny_server):
    tiny_server.post("/v1/completions", json={"model": "tiny", "prompt": ids(random.Random(2), 64),
                                              "max_tokens": 2})
    p = tiny_server.pages()
    assert p["num_cached_pages"] >= 4 and p["page_size"] == 16
    tiny_server.assert_no_leak()
    assert tiny_server.post("/flush_cache").json() == {"flushed": True}
    p = tiny_server.pages()
    assert p["num_free_pages"] == p["num_pages"] and p["num_cached_pages"] == 0


def test_debug_view_needs_the_flag_and_the_key(tiny_server, gguf_server):
    assert gguf_server.get("/debug/pages").status_code == 404
    r = httpx.get(f"{tiny_server.base_url}/debug/pages")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_abort_request_body_errors(tiny_server):
    assert tiny_server.post("/abort_request", json={}).status_code == 400
    assert tiny_server.post("/abort_request", json={"rid": 5}).status_code == 400
    assert tiny_server.post("/abort_request", json={"rid": "cmpl-unknown"}).json() == {"aborted": []}
    big = tiny_server.post("/abort_request", json={"rid": "x" * 200_000})
    assert big.status_code == 413 and len(big.content) < 1024
    assert big.json()["error"]["type"] == "invalid_request_error"


# ---- a server with long prompts, small prefill chunks and the debug view -----------------------
@pytest.fixture(scope="module")
def prod_server(request):
    server = start_tiny_server(request, ["--context-length", "2048", "--max-total-tokens", "32768",
                                         "--chunked-prefill-size", "64", "--page-size", "16",
                                         "--max-running-requests", "64",
                                         "--enable-debug-endpoints"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def first_chunk(lines) -> dict:
    line = next(l for l in lines if l.startswith("data: {"))
    return json.loads(line[len("data: "):])


def test_abort_request_by_response_id(prod_server):
    """The `id` of a response (or of any chunk) is the rid /abort_request takes."""
    body = {"model": prod_server.model, "prompt": "Go", "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    before = prod_server.metrics()
    with httpx.Client(limits=poller_limits(), base_url=prod_server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            rid = first_chunk(lines)["id"]
            assert http.post("/abort_request", json={"rid": rid}).json() == {"aborted": [rid]}
            rest = [json.loads(l[6:]) for l in lines if l.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert wait_for(lambda: prod_server.pages()["num_running"] == 0, 15)
    after = prod_server.metrics()
    assert delta(after, before, "num_aborted_requests_total") == 1
    assert delta(after, before, "num_requests_total") == 1
    assert delta(after, before, "e2e_request_latency_seconds_count") == 1
    prod_server.assert_no_leak()


def test_abort_all_ends_a_non_streaming_request(prod_server):
    body = {"model": prod_server.model, "prompt": "Go", "max_tokens": 1900, "ignore_eos": True}
    result: dict = {}

    def call() -> None:
        result["r"] = httpx.post(f"{prod_server.base_url}/v1/completions", json=body, timeout=60)

    t = threading.Thread(target=call)
    t.start()
    assert wait_for(lambda: prod_server.pages()["num_running"] == 1, 15)
    aborted = prod_server.post("/abort_request", json={"abort_all": True}).json()["aborted"]
    t.join(30)
    assert len(aborted) == 1 and result["r"].status_code == 200
    out = result["r"].json()
    assert out["id"] == aborted[0] and out["choices"][0]["finish_reason"] == "abort"
    assert wait_for(lambda: prod_server.pages()["num_running"] == 0, 15)
    prod_server.assert_no_leak()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_prefill_returns_pages(prod_server, stream):
    """C06/C19 during prefill: a 1500-token prompt takes 24 steps of 64 tokens, then 540
    decode steps (ignore_eos), far more than the client waits; the client leaves as soon as
    the request is accepted. Pages return, the aborted counter rises by one, the running
    gauge is 0 and the prompt is counted once."""
    prompt = ids(random.Random(3 + stream), 1500)
    body = {"model": prod_server.model, "prompt": prompt, "max_tokens": 540, "ignore_eos": True,
            "stream": stream}
    before = prod_server.metrics()
    if stream:
        with httpx.stream("POST", f"{prod_server.base_url}/v1/completions", json=body,
                          timeout=30) as r:
            assert r.status_code == 200  # headers go out once the engine accepted it
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{prod_server.base_url}/v1/completions", json=body,
                       timeout=httpx.Timeout(30, read=0.2))
    assert wait_for(lambda: prod_server.metrics()["radixserve:num_running_reqs"] == 0, 15)
    after = prod_server.metrics()
    assert delta(after, before, "num_aborted_requests_total") == 1
    assert delta(after, before, "num_requests_total") == 1
    assert delta(after, before, "prompt_tokens_total") == 1500
    assert after["radixserve:token_usage"] == 0
    prod_server.assert_no_leak()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_metrics_agree(prod_server, route):
    """C06: after a few chunks the client leaves; within a second running is 0, the generated
    token counter stops, pages return, the aborted counter rises by one."""
    body = {"model": prod_server.model, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    body.update({"prompt": "Write"} if "chat" not in route else
                {"messages": [{"role": "user", "content": "Write"}]})
    before = prod_server.metrics()
    with httpx.stream("POST", prod_server.base_url + route, json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            first_chunk(lines)
    assert wait_for(lambda: prod_server.metrics()["radixserve:num_running_reqs"] == 0, 15)
    after = prod_server.metrics()
    assert delta(after, before, "num_aborted_requests_total") == 1
    assert 4 <= delta(after, before, "generation_tokens_total") < 1900  # chat: 1st chunk is the role
    assert prod_server.metrics()["radixserve:generation_tokens_total"] == \
        after["radixserve:generation_tokens_total"]
    prod_server.assert_no_leak()


def run_stream(base_url: str, body: dict) -> tuple[str, int]:
    text, usage = "", None
    with httpx.stream("POST", base_url + "/v1/completions", timeout=300,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    text += choice["text"]
    return text, usage


def test_64_concurrent_streams_equal_sequential_and_leak_nothing(prod_server):
    """64 simultaneous streams, 4 shared prefixes (1-6 pages), mixed prompt and output lengths:
    every stream's text equals the same request run alone; afterwards no page is in use."""
    rng = random.Random(64)
    prefixes = [ids(rng, n) for n in (16, 40, 64, 96)]
    bodies = [{"model": prod_server.model, "prompt": prefixes[i % 4] + ids(rng, rng.randrange(1, 40)),
               "max_tokens": rng.randrange(1, 25), "ignore_eos": True, "temperature": 0}
              for i in range(64)]
    prod_server.post("/flush_cache")
    sequential = []
    for body in bodies:
        r = prod_server.post("/v1/completions", json=body)
        assert r.status_code == 200
        sequential.append(r.json()["choices"][0]["text"])
    prod_server.post("/flush_cache")
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda b: run_stream(prod_server.base_url, b), bodies))
    for i, ((text, n_tokens), want, body) in enumerate(zip(results, sequential, bodies)):
        assert text == want, f"stream {i} differs"
        assert n_tokens == body["max_tokens"]
    assert wait_for(lambda: prod_server.pages()["num_running"] == 0, 15)
    prod_server.assert_no_leak()
    assert prod_server.pages()["num_cached_pages"] > 0


def test_c03_shared_prefix_then_idle_self_check(prod_server):
    """C03 scaled down: 48 streams at concurrency 16 over a 1024-token common prefix plus a
    unique 64-token question; at idle the pool adds up, /health, /metrics and a new request
    all work."""
    rng = random.Random(3)
    system = ids(rng, 1024)
    bodies = [{"model": prod_server.model, "prompt": system + ids(rng, 64), "max_tokens": 16,
               "ignore_eos": True} for _ in range(48)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda b: run_stream(prod_server.base_url, b), bodies))
    assert all(n == 16 for _, n in results)
    assert wait_for(lambda: prod_server.pages()["num_running"] == 0, 15)
    prod_server.assert_no_leak()
    m = prod_server.metrics()
    assert m["radixserve:num_running_reqs"] == 0 and m["radixserve:token_usage"] == 0
    assert m["radixserve:cache_hit_rate"] > 0
    prod_server.assert_alive()
    prod_server.assert_no_leak()


# ---- small KV: preemption, then the engine killed under load -----------------------------------
@pytest.fixture(scope="module")
def small_server(request):
    """64 pages of 16 tokens: 16 concurrent requests of 100 + 100 tokens must preempt. No
    --stay-up-on-engine-death: the last test kills the engine and expects exit code 1."""
    server = start_tiny_server(request, ["--context-length", "512", "--max-total-tokens", "1024",
                                         "--page-size", "16", "--max-running-requests", "16",
                                         "--enable-debug-endpoints", "--watchdog-timeout", "60"])
    yield server
    server.stop()


def test_preemption_is_not_a_cache_hit(small_server):
    """C19: unique random prompts under forced preemption: cached tokens stay 0, the preemption
    counter rises, outputs complete, every counter reconciles with the responses."""
    rng = random.Random(19)
    bodies = [{"model": small_server.model, "prompt": ids(rng, 100), "max_tokens": 100,
               "ignore_eos": True} for _ in range(16)]
    before = small_server.metrics()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda b: small_server.post("/v1/completions", json=b), bodies))
    assert all(r.status_code == 200 for r in results)
    usages = [r.json()["usage"] for r in results]
    after = small_server.metrics()
    assert delta(after, before, "num_preempted_reqs_total") > 0
    assert delta(after, before, "cached_tokens_total") == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in usages)
    assert delta(after, before, "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta(after, before, "num_requests_total") == 16
    small_server.assert_no_leak()


def test_engine_killed_under_load(small_server):
    """C21: 8 streams running, SIGKILL the engine: every client gets an error or a closed
    stream (none hangs), /health is 503 within seconds, then the process exits with code 1."""
    engine_pid = small_server.get("/server_info").json()["engine_pid"]
    body = {"model": small_server.model, "prompt": "Go", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    started = threading.Barrier(9)
    outcomes: list[str] = []

    def client() -> None:
        try:
            with httpx.stream("POST", small_server.base_url + "/v1/completions", json=body,
                              timeout=httpx.Timeout(30)) as r:
                lines = r.iter_lines()
                first_chunk(lines)
                started.wait(30)
                rest = list(lines)
            outcomes.append("error" if any('"error"' in l for l in rest) else "ended")
        except httpx.TransportError:
            outcomes.append("transport error")

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(60)
    os.kill(engine_pid, signal.SIGKILL)
    statuses: list[int] = []

    def health_not_ok() -> bool:
        try:
            statuses.append(small_server.get("/health", timeout=1).status_code)
        except httpx.TransportError:
            statuses.append(0)  # already exited
        return statuses[-1] != 200

    assert wait_for(health_not_ok, 10)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a client hung after the engine died"
    assert len(outcomes) == 8 and "ended" not in outcomes, outcomes
    assert small_server.proc.wait(30) == 1
    assert 503 in statuses or statuses[-1] == 0
