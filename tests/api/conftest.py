"""API test fixtures: real `radixserve serve` subprocesses on free loopback ports, shared per session."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from radixserve.bench.launch import free_port
from radixserve.http_common import poller_limits
from tests.conftest import build_tiny_api_model

REPO = pathlib.Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0
API_KEY = "test-key"


class ServerProcess:
    """One server subprocess; `args` are the flags after `serve`. Output goes to a log file
    that is printed when start-up fails. `port`: a fixed port (a restart on the same address);
    `new_session`: its own process group, so a test can SIGKILL it with its engine;
    `log_level`: its --log-level; `num_threads`: its --num-threads unless `args` name one (one by
    default: a tiny model's step is all per-op overhead, and tests run several servers at once,
    whose torch threads would otherwise spin against each other on two cores; None: all cores)."""

    def __init__(self, args: list[str], api_key: str | None = None, port: int | None = None,
                 new_session: bool = False, log_level: str = "warning", num_threads: int | None = 1):
        self.port = port or free_port()
        self.api_key = api_key
        if num_threads and "--num-threads" not in args:
            args = [*args, "--num-threads", str(num_threads)]
        cmd = [sys.executable, "-m", "radixserve", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", log_level]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixserve-server-", suffix=".log",
                                               delete=False)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=new_session)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(limits=poller_limits(), base_url=self.base_url,
                                 headers=self.headers, timeout=120)

    def wait_ready(self) -> ServerProcess:
        """Wait for /health and read the model id; on any failure the server is stopped
        before the error propagates (a failed start-up must not leave a server running)."""
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during start-up:\n"
                            f"{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    models = self.get("/v1/models")
                    assert models.status_code == 200, models.text
                    self.model = models.json()["data"][0]["id"]
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.output()}")

    def output(self, tail_chars: int | None = 8000) -> str:
        self.log.flush()
        text = pathlib.Path(self.log.name).read_text()
        return text[-tail_chars:] if tail_chars else text

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none",
                                  max_retries=0, timeout=120)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def assert_alive(self) -> None:
        """GET /health is 200 and a trivial completion comes back within 10 s."""
        assert self.get("/health").status_code == 200, self.output()
        r = self.post("/v1/completions", timeout=10,
                      json={"model": self.model, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text

    def stats(self) -> dict:
        return self.get("/server_info").json()["engine"]

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {sample name: value} (label sets dropped: one model per server);
        histograms as `<name>_count` / `<name>_sum`."""
        from prometheus_client.parser import text_string_to_metric_families
        r = self.get("/metrics")
        assert r.status_code == 200, r.text
        return {s.name: s.value for fam in text_string_to_metric_families(r.text)
                for s in fam.samples if not s.name.endswith("_bucket")}

    def pages(self) -> dict:
        """GET /debug/pages (servers started with --enable-debug-endpoints)."""
        r = self.get("/debug/pages")
        assert r.status_code == 200, r.text
        return r.json()

    def assert_no_leak(self) -> None:
        """Idle: nothing running, no page in use, free + evictable == total, invariant holds."""
        p = self.pages()
        assert p["invariant_holds"], p
        assert p["num_running"] == 0 and p["num_waiting"] == 0, p
        assert p["num_in_use_pages"] == 0, p
        assert p["num_free_pages"] + p["num_evictable_pages"] == p["num_pages"], p

    def assert_no_tracebacks(self) -> None:
        """No request hit the catch-all 500 handler or crashed anything during the session."""
        log = self.output(tail_chars=None)
        at = max(log.find("Traceback"), log.find("unhandled error"))
        assert at < 0, log[max(at - 2000, 0):at + 12000]

    def stop(self) -> None:
        """Terminate (kill after 30 s) and delete the log; a second call does nothing."""
        if self.log.closed:
            return
        terminate(self.proc)
        self.http.close()
        self.log.close()
        os.unlink(self.log.name)


def terminate(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM `proc`, SIGKILL it if it is still running after `grace_s`; wait for its exit."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> pathlib.Path:
    """Tiny random-weight Llama with the default model's tokenizer (build_tiny_api_model)."""
    return build_tiny_api_model(tmp_path_factory.mktemp("tiny-llama-api"), default_tokenizer.hf)


TINY_CONTEXT = 512


def start_tiny_server(request, args: list[str], api_key: str | None = None,
                      log_level: str = "warning") -> ServerProcess:
    """A server over the tiny random-weight model with extra flags `args`."""
    model_dir = request.getfixturevalue("tiny_model_dir")
    return ServerProcess(["--model-path", str(model_dir), *args], api_key=api_key,
                         log_level=log_level).wait_ready()


@pytest.fixture(scope="session")
def tiny_server(request):
    """Tiny random-weight model, context 512, page size 16, an API key: fast, text meaningless."""
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT),
                                         "--max-total-tokens", "16384", "--page-size", "16",
                                         "--served-model-name", "tiny",
                                         "--enable-debug-endpoints"], api_key=API_KEY)
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def glm45_server(request):
    """Tiny model with the glm45 tool-call and reasoning parsers and fault injection (replies
    forced with sampler.force_tokens): shared by the tool-call and tool_choice modules."""
    from tests.api.tool_fixtures import parser_server
    yield from parser_server(request, ["--tool-call-parser", "glm45", "--reasoning-parser", "glm45"])


@pytest.fixture(scope="session")
def gguf_server():
    """The embedded default model (SmolLM2-135M-Instruct): for tests where the text matters."""
    server = ServerProcess(["--max-total-tokens", "16384", "--context-length", "2048"],
                           num_threads=None)
    yield server.wait_ready()
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()
