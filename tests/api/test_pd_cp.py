"""PD with a context-parallel prefill worker (C58, issue 42): `serve --disaggregation-mode prefill --cp-size 2` (rank 0
ends a CP prefill holding every layer's KV and sends it as a one-rank worker does) feeding a one-rank decode worker
behind `radixserve route` gives the colocated one-process worker's greedy tokens, for a GQA Llama and an MLA
glm4_moe_lite, prompts of odd and even lengths and a prefill-side prefix hit. Refused layouts: test_pd_layout.py."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixserve.bench.launch import free_port
from radixserve.http_common import poller_limits
from tests.api.conftest import REPO, ServerProcess
from tests.api.test_pd_api import _ok, wait_for

COMMON = ["--max-total-tokens", "16384", "--page-size", "16", "--context-length", "512",
          "--served-model-name", "tiny"]
LENGTHS = (2, 5, 16, 17, 33, 48)


def prefill_worker(model_dir) -> ServerProcess:
    """A `--cp-size 2` prefill worker (not yet ready)."""
    return ServerProcess(["--model-path", str(model_dir), *COMMON, "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(free_port()), "--disaggregation-transfer-timeout",
                          "10", "--cp-size", "2"], log_level="info")


@contextlib.contextmanager
def routed(model_dir, prefill: ServerProcess, decode_flags: list[str]):
    """A decode worker (`decode_flags` added) and a router to it and `prefill`; yields (decode, the router's client)."""
    decode = ServerProcess(["--model-path", str(model_dir), *COMMON, "--disaggregation-mode", "decode",
                            "--disaggregation-transfer-timeout", "10", *decode_flags], log_level="info")
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        assert prefill.stats()["runner"]["cp_size"] == 2
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "radixserve", "route", "--prefill", prefill.base_url,
                                   "--decode", decode.base_url, "--port", str(port), "--health-check-interval-s",
                                   "0.5", "--log-level", "warning"], cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(url + "/health"), "the router to be ready")
        with httpx.Client(limits=poller_limits(), base_url=url, timeout=120, trust_env=False) as client:
            yield decode, client
        decode.assert_no_tracebacks()
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        decode.stop()


def assert_same_greedy(ref: ServerProcess, router: httpx.Client) -> None:
    prompts = [[100 + 7 * i % 200 for i in range(n)] for n in LENGTHS]
    prompts.append(prompts[-1][:32] + [9, 8, 7])      # 35 tokens, 32 of them a prefix hit on the prefill worker
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 8, "logprobs": 1}
        got, want = router.post("/v1/completions", json=body), ref.post("/v1/completions", json=body)
        assert got.status_code == 200 == want.status_code, got.text
        g, w = got.json()["choices"][0], want.json()["choices"][0]
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"] and g["text"] == w["text"], len(prompt)
        assert abs(g["logprobs"]["token_logprobs"][0] - w["logprobs"]["token_logprobs"][0]) < 1e-3
        usage = got.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32


@pytest.fixture(scope="module")
def cp_prefill(tiny_model_dir):
    server = prefill_worker(tiny_model_dir)
    yield server
    try:
        assert "rank 1 of 2 joined" in server.output(tail_chars=None)
        server.assert_no_tracebacks()
    finally:
        server.stop()


@pytest.mark.parametrize("decode_flags", [[], ["--tp-size", "2"]], ids=["tp1-decode", "tp2-decode"])
def test_cp2_prefill_llama(tiny_server, tiny_model_dir, cp_prefill, decode_flags):
    """Llama's 2 KV heads: a TP 2 decode worker's ranks keep one head each of what the prefill worker sent."""
    with routed(tiny_model_dir, cp_prefill, decode_flags) as (decode, router):
        assert decode.stats()["runner"].get("tp_size", 1) == (2 if decode_flags else 1)
        assert_same_greedy(tiny_server, router)
        if decode_flags:
            assert_same_greedy_concurrent(tiny_server, router)


def assert_same_greedy_concurrent(ref: ServerProcess, router: httpx.Client, n: int = 32) -> None:
    """C58 at concurrency 32: prompts of 3..34 tokens at once, so CP prefill steps split several sequences."""
    prompts = [[50 + (5 * i + j) % 300 for j in range(3 + i)] for i in range(n)]

    def complete(client, prompt):
        return client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0,
                                                     "max_tokens": 6})

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda p: complete(router, p), prompts))
    for prompt, g in zip(prompts, got):
        want = complete(ref, prompt)
        assert g.status_code == 200, g.text
        assert g.json()["choices"][0]["text"] == want.json()["choices"][0]["text"], len(prompt)


@pytest.fixture(scope="module")
def mla_model_dir(default_tokenizer, tmp_path_factory):
    """A tiny glm4_moe_lite (MLA) with the default model's tokenizer and vocabulary."""
    from tests.model.test_families import FAMILIES, build_family

    config_cls, model_cls, extra = FAMILIES["glm4_moe_lite"]
    folder = tmp_path_factory.mktemp("pd-cp-mla")
    hf = default_tokenizer.hf
    build_family(folder, "glm4_moe_lite", spec=(config_cls, model_cls, {
        **extra, "vocab_size": len(hf), "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}))
    hf.save_pretrained(folder)
    return folder


def mla_runs_cp_and_tp(model_dir) -> bool:
    """Whether this build runs an MLA model under --cp-size (runner/cp.py) and --tp-size (models/llama.py): both are
    built on another branch (mla-tp) and refused here with a ValueError naming MLA."""
    from radixserve.engine_config import EngineConfig
    from radixserve.models.model_config import ModelConfig
    from radixserve.models.registry import model_class
    from radixserve.runner.cp import CPModelRunner

    class Rank:
        rank, size = 0, 2

    try:
        CPModelRunner.from_config(EngineConfig(model_path=str(model_dir), cp_size=2, max_total_tokens=256,
                                               num_threads=1), comm=Rank())
        config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
        model_class(config)(config, tp=Rank())
    except ValueError as exc:
        if "MLA" in str(exc):
            return False
        raise
    return True


def test_cp2_prefill_mla_to_tp2_decode(mla_model_dir):
    """MLA: the latent is one head, replicated; every TP rank imports all of it (the TP 1 import is Llama's path)."""
    if not mla_runs_cp_and_tp(mla_model_dir):
        pytest.skip("MLA under --cp-size and --tp-size is not in this build (built on branch mla-tp)")
    ref = ServerProcess(["--model-path", str(mla_model_dir), *COMMON])
    prefill = prefill_worker(mla_model_dir)
    try:
        with routed(mla_model_dir, prefill, ["--tp-size", "2"]) as (decode, router):
            ref.wait_ready()
            assert decode.stats()["runner"]["tp_size"] == 2
            assert_same_greedy(ref, router)
    finally:
        ref.stop()
        prefill.stop()


@pytest.mark.parametrize("flags, message", [
    (["decode", "--cp-size", "2"], "--disaggregation-mode decode with --tp-size 1 --cp-size 2 is not built yet"),
    (["prefill", "--tp-size", "2"], "--disaggregation-mode prefill with --tp-size 2 --cp-size 1 is not built yet"),
    (["prefill", "--cp-size", "2", "--enable-layer-split"], "--cp-size 2 --enable-layer-split is not built yet"),
    (["prefill", "--pp-size", "2"], "--pp-size 2 cannot be combined with --disaggregation-mode"),
], ids=["cp2-decode", "tp2-prefill", "layer-split-prefill", "pp2-prefill"])
def test_unbuilt_layouts_refused_at_start_up(flags, message):
    """Before any model loads: exit code 2 and the layout named (the handshake refuses the rest: test_pd_layout.py)."""
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", "unused",
                           "--disaggregation-mode", *flags], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and message in done.stderr, done.stderr
