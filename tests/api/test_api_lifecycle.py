"""Worker lifecycle over HTTP: client disconnect aborts (C06), engine death turns /health 503 and
fails requests instead of hanging (C21), start-up message, clean shutdown of both processes."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from radixserve.http_common import poller_limits

from tests.api.conftest import start_tiny_server


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def idle(server) -> bool:
    stats = server.stats()
    return stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.fixture(scope="module")
def long_server(request):
    """Context 2048, so that an unaborted request would keep the engine busy for seconds."""
    server = start_tiny_server(request, ["--max-total-tokens", "8192", "--context-length", "2048",
                                         "--max-running-requests", "2", "--max-queued-requests", "1"])
    yield server
    server.stop()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_aborts(long_server, route):
    body = {"model": long_server.model, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    body.update({"prompt": "Write an essay"} if "chat" not in route else
                {"messages": [{"role": "user", "content": "Write an essay"}]})
    before = long_server.stats()["num_aborted_requests"]
    with httpx.Client(limits=poller_limits(), base_url=long_server.base_url) as http:
        with http.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if '"content"' in line or '"text"' in line)
    assert wait_for(lambda: idle(long_server), 5), long_server.stats()
    assert long_server.stats()["num_aborted_requests"] == before + 1
    long_server.assert_alive()


def test_non_stream_disconnect_aborts(long_server):
    body = {"model": long_server.model, "prompt": "Write an essay", "max_tokens": 2000,
            "ignore_eos": True, "n": 2}
    before = long_server.stats()["num_aborted_requests"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{long_server.base_url}/v1/completions", json=body,
                   timeout=httpx.Timeout(10, read=0.5))
    assert wait_for(lambda: idle(long_server), 5), long_server.stats()
    assert long_server.stats()["num_aborted_requests"] == before + 2
    long_server.assert_alive()


def test_overload_is_503_and_recovers(long_server):
    """With 2 running + 1 queued allowed, a 4th concurrent request is refused with 503."""
    body = {"model": long_server.model, "prompt": "Go on", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(limits=poller_limits(), base_url=long_server.base_url, timeout=30) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200, 200]
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert wait_for(lambda: idle(long_server), 5), long_server.stats()
    long_server.assert_alive()


def test_flush_cache_and_server_info(tiny_server):
    assert tiny_server.post("/flush_cache").json() == {"flushed": True}
    info = tiny_server.get("/get_server_info").json()
    assert info["model"] == tiny_server.model and info["engine"]["num_running"] == 0
    assert info["server_config"]["api_key"] is None and info["page_size"] == 16
    assert set(tiny_server.get("/server_info").json()) == set(info)
    assert info["engine"]["runner"] == {"device": "cpu", "attention_backend": "torch",
                                        "kv_cache_dtype": "float32",
                                        "deterministic_inference": False, "quantization": "none"}
    assert tiny_server.get("/health_generate").status_code == 200


def test_fp8_kv_server_serves_and_reports_its_scales(request):
    """C37: /get_server_info names the scales' source and values; FP8 KV serves requests."""
    server = start_tiny_server(request, ["--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "4096",
                                         "--enable-debug-endpoints"])
    try:
        runner = server.get("/get_server_info").json()["engine"]["runner"]
        assert runner["kv_cache_dtype"] == "float8_e4m3fn"
        assert runner["kv_scales"]["source"] == "calibration"
        assert len(runner["kv_scales"]["k_scale"]) == 2 and 1.0 not in runner["kv_scales"]["k_scale"]
        body = {"model": server.model, "prompt": "Hello there, " * 20, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        first, second = (server.post("/v1/completions", json=body).json() for _ in range(2))
        assert first["usage"]["completion_tokens"] == 8
        assert first["choices"][0]["text"] == second["choices"][0]["text"]      # second from the cache
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        pages = server.get("/debug/pages").json()
        assert pages["invariant_holds"] and pages["num_in_use_pages"] == 0
    finally:
        server.stop()


@pytest.fixture
def own_server(request):
    """A server of the test's own, logging at INFO (its start-up progress lines)."""
    server = start_tiny_server(request, ["--max-total-tokens", "4096", "--context-length", "1024",
                                         "--stay-up-on-engine-death"], log_level="info")
    yield server
    server.stop()


def test_engine_death_is_reported(own_server):
    """C21: kill the engine process mid-stream: the stream ends with an error, /health goes 503
    and new requests fail fast with 503, without hanging."""
    engine_pid = own_server.get("/server_info").json()["engine_pid"]
    body = {"model": own_server.model, "prompt": "Go", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    assert own_server.get("/metrics").status_code == 200  # a snapshot to show after death
    events: list[str] = []

    def read_stream() -> None:
        with httpx.stream("POST", f"{own_server.base_url}/v1/completions", json=body,
                          timeout=30) as r:
            for line in filter(None, r.iter_lines()):
                events.append(line)
                if len(events) == 3:
                    os.kill(engine_pid, signal.SIGKILL)

    reader = threading.Thread(target=read_stream)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "stream hung after the engine died"
    assert any('"error"' in e for e in events) and events[-1] == "data: [DONE]"
    assert wait_for(lambda: own_server.get("/health").status_code == 503, 5)
    assert own_server.get("/health").json()["error"]["type"] == "engine_dead"
    scrape = own_server.get("/metrics")  # stays up (--stay-up-on-engine-death): last snapshot
    assert scrape.status_code == 200 and "radixserve:num_requests_total" in scrape.text
    r = own_server.post("/v1/completions", json={"model": own_server.model, "prompt": "Hi"},
                        timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead"


def test_startup_progress_and_clean_shutdown(own_server):
    """Start-up says what it is doing, in order, and ends with the URL; SIGINT stops it (0)."""
    assert wait_for(lambda: "radixserve: serving" in own_server.output(), 5)
    lines = own_server.output(tail_chars=None).splitlines()
    steps = ["loading the tokenizer of", "starting the engine process", "loading the model from",
             "loaded ", "radixserve: serving"]
    at = [next((i for i, line in enumerate(lines) if step in line), None) for step in steps]
    assert None not in at and at == sorted(at), (at, lines)
    line = lines[at[-1]]
    assert f"127.0.0.1:{own_server.port}" in line and "loaded in" in line
    engine_pid = own_server.get("/server_info").json()["engine_pid"]
    own_server.proc.send_signal(signal.SIGINT)
    assert own_server.proc.wait(30) == 0

    def gone() -> bool:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return True
        return False
    assert wait_for(gone, 10), "engine process outlived the server"
