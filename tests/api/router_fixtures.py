"""Router test fixtures: a `radixserve fleet` of two tiny workers behind a router, with worker kill and restart."""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import pytest

from radixserve.bench.launch import free_ports
from radixserve.http_common import poller_limits
from tests.api.conftest import API_KEY, REPO, STARTUP_TIMEOUT_S

ADMIN_KEY = "admin-key"
WAIT_S = 60.0  # generous bound on every wait for a state change (never a pass/fail timing)
# Fast health checks and breaker recovery so kills and restarts show within a second or two.
ROUTER_FLAGS = ["--health-check-interval-s", "0.3", "--health-failure-threshold", "2",
                "--health-success-threshold", "2", "--cb-timeout-s", "1",
                "--load-poll-interval-s", "0.5", "--retry-initial-backoff-ms", "10",
                "--admin-api-key", ADMIN_KEY, "--worker-api-key", API_KEY, "--log-level", "warning"]


def tiny_worker_flags(model_dir: pathlib.Path) -> list[str]:
    return ["--model-path", str(model_dir), "--context-length", "512", "--max-total-tokens",
            "16384", "--page-size", "16", "--served-model-name", "tiny", "--api-key", API_KEY,
            "--enable-fault-injection", "--num-threads", "1"]   # see ServerProcess's num_threads


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


class Fleet:
    """`radixserve fleet --num-workers N` (default 2) over the tiny model (its own process
    group), the router on `router_url`, `worker_flags` added to each worker's; `restarted`
    holds workers this fixture started again."""

    def __init__(self, model_dir: pathlib.Path, router_flags: list[str] = ROUTER_FLAGS,
                 num_workers: int = 2, worker_flags: tuple[str, ...] = ()):
        self.tmp = tempfile.mkdtemp(prefix="radixserve-router-test-")
        atexit.register(shutil.rmtree, self.tmp, True)   # logs stay readable until the test process ends
        self.manifest_path = os.path.join(self.tmp, "manifest.json")
        self.num_workers = num_workers
        base = free_ports(1 + num_workers)  # router, worker 0, worker 1, ...
        self.port = base
        cmd = [sys.executable, "-m", "radixserve", "fleet", "--num-workers", str(num_workers),
               "--worker-base-port", str(base + 1), "--port", str(self.port),
               "--manifest", self.manifest_path, "--log-dir", self.tmp, *router_flags,
               *tiny_worker_flags(model_dir), *worker_flags]
        self.log = open(os.path.join(self.tmp, "fleet.log"), "w+")
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.router_url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(limits=poller_limits(), base_url=self.router_url, timeout=120,
                                 trust_env=False,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        self.restarted: dict[str, subprocess.Popen] = {}

    def output(self) -> str:
        self.log.flush()
        return pathlib.Path(self.log.name).read_text()[-8000:]

    def wait_ready(self) -> Fleet:
        def manifest() -> dict | None:
            if self.proc.poll() is not None:
                pytest.fail(f"fleet exited with {self.proc.returncode}:\n{self.output()}")
            if os.path.exists(self.manifest_path):
                return json.loads(pathlib.Path(self.manifest_path).read_text())
            return None
        self.manifest = wait_for(manifest, "the fleet manifest", STARTUP_TIMEOUT_S)
        self.urls = [w["url"] for w in self.manifest["workers"]]
        wait_for(lambda: port_open(self.router_url) and self.all_healthy(), "a healthy router")
        return self

    # ----------------------------------------------------------------------------- router calls
    def admin(self, method: str, path: str, key: str | None = ADMIN_KEY, **kw) -> httpx.Response:
        headers = {**kw.pop("headers", {}),
                   "Authorization": f"Bearer {key}" if key else ""}
        return self.http.request(method, path, headers=headers, **kw)

    def workers(self) -> dict[str, dict]:
        r = self.admin("GET", "/admin/workers")
        assert r.status_code == 200, r.text
        return {w["url"]: w for w in r.json()["workers"]}

    def all_healthy(self) -> bool:
        ws = self.workers()
        return len(ws) == self.num_workers and all(w["healthy"] and w["breaker"] == "closed" for w in ws.values())

    def counts(self) -> dict[str, int]:
        return {url: w["num_requests"] for url, w in self.workers().items()}

    def complete(self, prompt: Any, max_tokens: int = 2, base_url: str | None = None,
                 **extra) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra}
        url = (base_url or self.router_url) + "/v1/completions"
        return self.http.post(url, json=body)

    def complete_all(self, prompts: list, **kw) -> list[httpx.Response]:
        """The prompts sent at once (one thread each)."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, **kw), prompts))

    def served_by(self, send: Callable[[], httpx.Response]) -> tuple[str, httpx.Response]:
        """Send one request (nothing else in flight) and name the worker the router chose."""
        before = self.counts()
        r = send()
        after = self.counts()
        moved = [url for url in after if after[url] != before.get(url, 0)]
        assert len(moved) == 1, (moved, r.text)
        return moved[0], r

    def metric_samples(self) -> list:
        from prometheus_client.parser import text_string_to_metric_families
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        return list(text_string_to_metric_families(r.text))

    # ---------------------------------------------------------------------------- worker control
    def pid_of(self, url: str) -> int:
        if url in self.restarted:
            return self.restarted[url].pid
        return next(w["pid"] for w in self.manifest["workers"] if w["url"] == url)

    def kill(self, url: str) -> None:
        """SIGKILL the worker's process group (HTTP server and engine) and wait until its
        port refuses connections."""
        os.killpg(self.pid_of(url), signal.SIGKILL)
        wait_for(lambda: not port_open(url), f"{url} to stop listening")

    def restart(self, url: str) -> None:
        """Start the worker again with the fleet's argv (same port) and wait for /health."""
        argv = next(w["argv"] for w in self.manifest["workers"] if w["url"] == url)
        log = open(os.path.join(self.tmp, f"restart-{url.rsplit(':', 1)[1]}.log"), "ab")
        self.restarted[url] = subprocess.Popen(argv, cwd=REPO, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)

        def up() -> bool:
            if self.restarted[url].poll() is not None:
                pytest.fail(f"restarted worker {url} exited with {self.restarted[url].returncode}")
            try:
                return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, f"{url} to start again", STARTUP_TIMEOUT_S)

    def stop(self) -> int | None:
        """SIGTERM the fleet (it stops its workers), then anything this fixture restarted.
        Returns the fleet's exit code (None if it had to be killed)."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for proc in self.restarted.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.http.close()
        self.log.close()
        return code


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
