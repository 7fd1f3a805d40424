"""Graceful drain over HTTP (C41): SIGTERM or /admin/drain on a worker, SIGTERM on a router, and a grace period that runs out. Streams are kept in flight by the worker's step_latency fault (each step sleeps), released by clearing it, never by hoping for speed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

import httpx
import pytest

from radixserve.bench.launch import free_port
from tests.api.conftest import REPO, start_tiny_server
from tests.api.router_fixtures import WAIT_S, wait_for

SLOW_STEP_MS = 1000     # with MAX_TOKENS: a stream needs 64 s unless the fault is cleared
MAX_TOKENS = 64
WORKER_FLAGS = ["--context-length", "1024", "--max-total-tokens", "16384",
                "--enable-fault-injection"]


class Stream(threading.Thread):
    """One streamed completion read on its own thread: `events` are the SSE data fields in
    order; `started` is set at the first one."""

    def __init__(self, url: str, body: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.events, self.started = url, [], threading.Event()
        self.body = body or {"prompt": "Tell me a story", "max_tokens": MAX_TOKENS,
                             "ignore_eos": True, "stream": True}
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120,
                          trust_env=False) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.started.set()

    def finish_reasons(self) -> list[str]:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", [])
                if c.get("finish_reason")]

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events
                if e != "[DONE]" and "error" in json.loads(e)]


def slow_down(base_url: str) -> None:
    r = httpx.post(base_url + "/admin/fault", json={"kind": "step_latency",
                                                    "latency_ms": SLOW_STEP_MS}, timeout=30)
    assert r.status_code == 200, r.text


def speed_up(base_url: str) -> None:
    assert httpx.delete(base_url + "/admin/fault", timeout=30).status_code == 200


def health(base_url: str) -> httpx.Response:
    return httpx.get(base_url + "/health", timeout=10, trust_env=False)


def complete(base_url: str) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", timeout=60, trust_env=False,
                      json={"prompt": "Hi", "max_tokens": 2})


def assert_refused_as_draining(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "draining"), error


def says_draining(base_url: str) -> bool:
    r = health(base_url)
    return r.status_code == 503 and r.json().get("status") == "draining"


def open_streams(base_url: str, n: int) -> list[Stream]:
    streams = [Stream(base_url) for _ in range(n)]
    for s in streams:
        assert s.started.wait(WAIT_S), "stream never started"
    return streams


def test_worker_admin_drain_then_sigterm_finishes_every_stream_and_exits_0(request):
    """(c) /admin/drain refuses new requests and /health says draining; /admin/undrain admits
    again. (a) SIGTERM with streams in flight: they run to "length", new requests get 503, the
    worker exits 0 once the last finishes, well inside its 120 s grace, without a traceback."""
    server = start_tiny_server(request, [*WORKER_FLAGS, "--graceful-shutdown-timeout", "120"],
                               log_level="info")
    try:
        url = server.base_url
        assert server.post("/admin/drain").json()["status"] == "draining"
        assert says_draining(url)
        live = httpx.get(url + "/live", timeout=10)        # drained, not dead: no restart
        assert live.status_code == 200 and live.json() == {"status": "alive"}
        assert_refused_as_draining(complete(url))
        assert server.post("/admin/undrain").json()["status"] == "ok"
        assert health(url).status_code == 200 and complete(url).status_code == 200

        slow_down(url)
        streams = open_streams(url, 4)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: says_draining(url), "/health to say draining")
        assert health(url).json()["shutting_down"] is True
        assert_refused_as_draining(complete(url))
        assert server.post("/admin/undrain").status_code == 400   # no way back from SIGTERM
        speed_up(url)
        for s in streams:
            s.join(WAIT_S)
            assert not s.is_alive(), "stream hung after SIGTERM"
            assert s.status == 200 and s.errors() == [] and s.events[-1] == "[DONE]"
            assert s.finish_reasons() == ["length"], s.events[-3:]
        assert server.proc.wait(WAIT_S) == 0
        log = server.output(tail_chars=None)
        assert "shutting down: 4 request(s) in flight" in log, log
        assert "Traceback" not in log and "cut off" not in log, log
    finally:
        server.stop()


def test_worker_grace_period_running_out_ends_streams_with_an_error_and_requests_with_503(request):
    """A stream still running when the grace period ends gets an SSE error event then
    [DONE]; a non-streamed request gets a 503 error body, never a truncated 200; exit 0."""
    server = start_tiny_server(request, [*WORKER_FLAGS, "--graceful-shutdown-timeout", "1"],
                               log_level="info")
    try:
        url = server.base_url
        slow_down(url)
        stream = open_streams(url, 1)[0]
        replies: list[httpx.Response] = []
        whole = threading.Thread(target=lambda: replies.append(httpx.post(
            url + "/v1/completions", timeout=120, trust_env=False,
            json={"prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True})), daemon=True)
        whole.start()
        wait_for(lambda: server.get("/server_info").json()["num_open_requests"] == 2,
                 "both requests in the engine")
        server.proc.send_signal(signal.SIGTERM)
        stream.join(WAIT_S)
        whole.join(WAIT_S)
        assert not stream.is_alive() and not whole.is_alive()
        assert stream.events[-1] == "[DONE]" and stream.finish_reasons() == []
        (error,) = stream.errors()
        assert (error["type"], error["code"]) == ("service_unavailable", "draining")
        assert "grace period of 1 s" in error["message"]
        assert_refused_as_draining(replies[0])
        assert server.proc.wait(WAIT_S) == 0
        log = server.output(tail_chars=None)
        assert "2 request(s) cut off" in log and "Traceback" not in log, log
    finally:
        server.stop()


@pytest.fixture
def worker(request):
    server = start_tiny_server(request, WORKER_FLAGS)
    yield server
    server.stop()


def test_router_routes_around_a_draining_worker_and_drains_itself_on_sigterm(worker):
    """(c) through a router: a worker's own drain takes it out of rotation at its next health
    check and its undrain brings it back. (b) SIGTERM on the router: new requests get 503,
    the streams in flight finish with "length", and the router exits 0."""
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="radixserve-router-", suffix=".log")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    router = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "route", "--worker-urls", worker.base_url,
         "--port", str(port), "--health-check-interval-s", "0.3",
         "--graceful-shutdown-timeout", "120", "--log-level", "info"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def routable() -> bool:
        try:
            return health(router_url).status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_for(routable, "the router to route")
        assert worker.post("/admin/drain").status_code == 200
        wait_for(lambda: not routable(), "the router to take the draining worker out")
        assert complete(router_url).status_code == 503
        assert worker.post("/admin/undrain").status_code == 200
        wait_for(routable, "the router to put the worker back")
        assert complete(router_url).status_code == 200

        slow_down(worker.base_url)
        streams = open_streams(router_url, 3)
        router.send_signal(signal.SIGTERM)
        wait_for(lambda: says_draining(router_url), "the router's /health to say draining")
        assert_refused_as_draining(complete(router_url))
        speed_up(worker.base_url)
        for s in streams:
            s.join(WAIT_S)
            assert not s.is_alive() and s.events[-1] == "[DONE]" and s.errors() == []
            assert s.finish_reasons() == ["length"]
        assert router.wait(WAIT_S) == 0
        log.seek(0)
        text = log.read()
        assert "shutting down: 3 request(s) in flight" in text and "Traceback" not in text, text
        worker.assert_alive()
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
        log.close()
