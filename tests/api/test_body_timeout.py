"""A client that declares a longer body than it sends gets 408 request_timeout from a worker and from a router (--request-body-timeout), and both keep serving."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixserve.bench.launch import free_port
from tests.api.conftest import REPO, start_tiny_server, terminate

WAIT_S = 60.0   # generous bound on every wait (never a pass/fail timing)


def stalled_post(port: int, path: str) -> tuple[int, dict, bytes]:
    """POST `path` declaring 100 body bytes and sending 10; returns the answer's status, JSON
    body and headers, read until the server closes the connection."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(head + b'{"prompt":')
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    headers, _, body = data.partition(b"\r\n\r\n")
    return int(headers.split()[1]), json.loads(body), headers.lower()


def assert_timed_out(status: int, body: dict, headers: bytes) -> None:
    assert status == 408, body
    assert body["error"]["type"] == body["error"]["code"] == "request_timeout", body
    assert "--request-body-timeout" in body["error"]["message"]
    assert b"connection: close" in headers


@pytest.fixture(scope="module")
def server(request):
    server = start_tiny_server(request, ["--request-body-timeout", "1", "--enable-debug-endpoints"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def test_a_stalled_body_gets_408_from_the_worker_which_keeps_serving(server):
    assert_timed_out(*stalled_post(server.port, "/v1/completions"))
    r = server.post("/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    server.assert_no_leak()


@pytest.fixture(scope="module")
def router():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "route", "--worker-urls",
                             "--port", str(port), "--request-body-timeout", "1",
                             "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(f"{url}/health", timeout=2, trust_env=False)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    else:
        terminate(proc)
        pytest.fail("the router did not answer /health")
    yield port, url
    terminate(proc)


def test_a_stalled_body_gets_408_from_the_router_which_keeps_serving(router):
    port, url = router
    assert_timed_out(*stalled_post(port, "/v1/chat/completions"))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=WAIT_S, trust_env=False)
    assert r.status_code == 503 and r.json()["error"]["type"] == "no_worker_available", r.text
