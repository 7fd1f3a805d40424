"""A new `radixserve agent` process adopts the drains an earlier agent left at a real `radixserve route`, and leaves the operator's alone (stub workers: no model)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from radixserve.bench.launch import free_port
from tests.api.conftest import REPO, terminate
from tests.api.router_fixtures import wait_for

METRICS = b"# TYPE radixserve:num_requests counter\nradixserve:num_requests_total 0.0\n"
ROUTER_FLAGS = ["--health-check-interval-s", "0.3", "--log-level", "warning"]
AGENT_FLAGS = ["--sweep-interval-s", "0.2", "--request-timeout-s", "2", "--base-ejection-s",
               "0.5", "--heartbeat-sweeps", "1000", "--log-level", "warning"]


class StubWorker(BaseHTTPRequestHandler):
    """A healthy idle worker: /health, /metrics, /get_server_info as a worker answers them."""

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(METRICS, "text/plain; version=0.0.4")
        elif self.path == "/get_server_info":
            self._send(json.dumps({"engine_pid": 1, "engine": {
                "num_running": 0, "num_waiting": 0, "token_usage": 0.0}}).encode())
        else:
            self._send(b'{"status": "ok"}')

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stubs():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), StubWorker) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def start(args: list[str], log: pathlib.Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "radixserve", *args], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)


def test_a_new_agent_returns_the_worker_an_earlier_agent_drained_not_the_operators(stubs, tmp_path):
    w0, w1, w2 = stubs
    router_url = f"http://127.0.0.1:{free_port()}"
    router = start(["route", "--worker-urls", *stubs, "--port", router_url.rsplit(":", 1)[1],
                    *ROUTER_FLAGS], tmp_path / "router.log")
    agent = None
    http = httpx.Client(base_url=router_url, timeout=10, trust_env=False)
    try:
        def listing() -> dict[str, dict]:
            try:
                return {w["url"]: w for w in http.get("/admin/workers").json()["workers"]}
            except httpx.HTTPError:
                return {}
        wait_for(lambda: len(listing()) == 3 and all(w["healthy"] for w in listing().values()),
                 "the router to see three healthy workers")
        # What an agent stopped mid-isolation leaves behind, and an operator's drain.
        assert http.post("/admin/drain", json={"url": w0, "by": "agent"}).status_code == 200
        assert http.post("/admin/drain", json={"url": w1}).status_code == 200
        assert {u: w["drained_by"] for u, w in listing().items()} == {
            w0: "agent", w1: "operator", w2: None}
        log = tmp_path / "decisions.jsonl"
        agent_port = free_port()
        agent = start(["agent", "--router", router_url, "--port", str(agent_port),
                       "--decision-log", str(log), *AGENT_FLAGS], tmp_path / "agent.log")
        wait_for(lambda: listing().get(w0, {}).get("draining") is False,
                 "the new agent to return the worker an earlier agent drained")

        def sweeps() -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{agent_port}/status", timeout=10,
                                 trust_env=False).json()["sweeps"]
            except httpx.HTTPError:
                return 0
        seen = sweeps()
        wait_for(lambda: sweeps() >= seen + 5, "five more sweeps")
        assert listing()[w1]["draining"] is True and listing()[w1]["drained_by"] == "operator"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(r["action"], r["result"][:2]) for r in records
                if r["worker"] == w0 and r["action"] != "none"] == [("adopt", "-"), ("undrain", "ok")]
        assert not [r for r in records if r["worker"] == w1]
    finally:
        http.close()
        for proc in (agent, router):
            if proc is not None:
                terminate(proc)
