"""PD with a parallel prefill worker (C58, issue 42): `serve --disaggregation-mode prefill --cp-size 2` (rank 0 ends a
CP prefill holding every layer's KV and sends it as a one-rank worker does), the same with `--enable-layer-split`
(rank 0 first gathers the layers the other rank owns) and `--tp-size 2` (rank 0 gathers the other rank's KV heads)
feeding a one-rank or TP 2 decode worker behind `radixserve route` give the colocated one-process worker's greedy
tokens, for a GQA Llama (and an MLA + DSA glm_moe_dsa from LayerSplit), prompts of odd and even lengths and a
prefill-side prefix hit; client aborts leak no page on either side. Refused layouts: test_pd_layout.py."""
from __future__ import annotations

import contextlib
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
          "--served-model-name", "tiny", "--enable-debug-endpoints"]
LENGTHS = (2, 5, 16, 17, 33, 48)
CP2, LAYER_SPLIT, TP2 = ["--cp-size", "2"], ["--cp-size", "2", "--enable-layer-split"], ["--tp-size", "2"]


def prefill_worker(model_dir, flags: list[str] = CP2) -> ServerProcess:
    """A prefill worker of 2 ranks, `flags` its layout (not yet ready)."""
    return ServerProcess(["--model-path", str(model_dir), *COMMON, "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(free_port()), "--disaggregation-transfer-timeout",
                          "10", *flags], log_level="info")


@contextlib.contextmanager
def routed(model_dir, prefills: list[ServerProcess], decode_flags: list[str]):
    """A decode worker (`decode_flags` added) and one router from each of `prefills` to it; yields (decode, the
    routers' clients in `prefills` order)."""
    decode = ServerProcess(["--model-path", str(model_dir), *COMMON, "--disaggregation-mode", "decode",
                            "--disaggregation-transfer-timeout", "10", *decode_flags], log_level="info")
    routers, clients = [], []
    try:
        decode.wait_ready()
        with contextlib.ExitStack() as stack:
            for prefill in prefills:
                prefill.wait_ready()
                port = free_port()
                routers.append(subprocess.Popen([sys.executable, "-m", "radixserve", "route", "--prefill",
                                                 prefill.base_url, "--decode", decode.base_url, "--port", str(port),
                                                 "--health-check-interval-s", "0.5", "--log-level", "warning"],
                                                cwd=REPO))
                url = f"http://127.0.0.1:{port}"
                wait_for(lambda url=url: _ok(url + "/health"), "the router to be ready")
                clients.append(stack.enter_context(httpx.Client(limits=poller_limits(), base_url=url, timeout=120,
                                                                trust_env=False)))
            yield decode, clients
        decode.assert_no_tracebacks()
    finally:
        for router in routers:
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


def serve_prefill(model_dir, flags: list[str] = CP2):
    server = prefill_worker(model_dir, flags)
    yield server
    try:
        assert "rank 1 of 2 joined" in server.output(tail_chars=None)
        server.assert_no_tracebacks()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cp_prefill(tiny_model_dir):
    yield from serve_prefill(tiny_model_dir)


@pytest.fixture(scope="module")
def ls_prefill(tiny_model_dir):
    yield from serve_prefill(tiny_model_dir, LAYER_SPLIT)


@pytest.fixture(scope="module")
def tp_prefill(tiny_model_dir):
    yield from serve_prefill(tiny_model_dir, TP2)


@pytest.mark.parametrize("decode_flags", [[], TP2], ids=["tp1-decode", "tp2-decode"])
def test_cp2_and_tp2_prefill_llama(tiny_server, tiny_model_dir, cp_prefill, ls_prefill, tp_prefill, decode_flags):
    """Llama's 2 KV heads, from a plain CP, a LayerSplit and a TP 2 prefill worker (one KV head per rank, gathered):
    a TP 2 decode worker's ranks keep one head each of what the prefill worker sent. Client aborts first (TP 1
    decode): the LayerSplit and TP groups stay in step."""
    with routed(tiny_model_dir, [cp_prefill, ls_prefill, tp_prefill], decode_flags) as (decode, routers):
        assert decode.stats()["runner"].get("tp_size", 1) == (2 if decode_flags else 1)
        assert ls_prefill.stats()["runner"]["layer_split"] and tp_prefill.stats()["runner"]["tp_size"] == 2
        if not decode_flags:
            for router, prefill in zip(routers[1:], (ls_prefill, tp_prefill)):
                assert_aborts_leak_nothing(router, [prefill, decode])
        for router in routers:
            assert_same_greedy(tiny_server, router)
            if decode_flags:
                assert_same_greedy_concurrent(tiny_server, router)


def assert_aborts_leak_nothing(router: httpx.Client, servers: list[ServerProcess]) -> None:
    """16 prompts of 100..400 tokens, each abandoned by its client after 10..160 ms: then no page in use anywhere."""
    def abandon(i: int) -> bool:
        body = {"model": "tiny", "prompt": [60 + (3 * i + j) % 400 for j in range(100 + 20 * i)], "max_tokens": 32}
        try:
            router.post("/v1/completions", json=body, timeout=0.01 * (1 + i))
        except httpx.TimeoutException:
            return True
        return False

    with ThreadPoolExecutor(8) as pool:
        assert any(pool.map(abandon, range(16)))
    for server in servers:
        wait_for(lambda server=server: server.pages()["num_in_use_pages"] == 0, "idle pages")
        server.assert_no_leak()


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
def dsa_model_dir(default_tokenizer, tmp_path_factory):
    """A tiny glm_moe_dsa (MLA + DSA, top-8 index) with the default model's tokenizer and vocabulary."""
    from tests.model.test_families import FAMILIES, build_family

    config_cls, model_cls, extra = FAMILIES["glm_moe_dsa"]
    folder = tmp_path_factory.mktemp("pd-cp-dsa")
    hf = default_tokenizer.hf
    build_family(folder, "glm_moe_dsa", spec=(config_cls, model_cls, {
        **extra, "vocab_size": len(hf), "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}))
    hf.save_pretrained(folder)
    return folder


def test_cp2_layer_split_prefill_dsa_to_tp2_decode(dsa_model_dir):
    """MLA + DSA from a LayerSplit prefill worker: the latent and the index keys of rank 1's layer (a full DSA layer)
    reach a TP 2 decode worker. Both are replicated under TP, so each rank, rank 0 first, imports all of them as a
    one-rank decode worker does (ModelRunner.import_kv): TP 2 covers TP 1's import."""
    ref = ServerProcess(["--model-path", str(dsa_model_dir), *COMMON])
    prefill = prefill_worker(dsa_model_dir, LAYER_SPLIT)
    try:
        with routed(dsa_model_dir, [prefill], TP2) as (decode, routers):
            ref.wait_ready()
            assert decode.stats()["runner"]["tp_size"] == 2
            assert_same_greedy(ref, routers[0])
        wait_for(lambda: prefill.pages()["num_in_use_pages"] == 0, "idle pages")
        prefill.assert_no_leak()
    finally:
        ref.stop()
        prefill.stop()


@pytest.mark.parametrize("flags, message", [
    (["decode", "--cp-size", "2"], "--disaggregation-mode decode with --tp-size 1 --cp-size 2 is not built yet"),
    (["decode", "--cp-size", "2", "--enable-layer-split"], "decode with --tp-size 1 --cp-size 2 --enable-layer-split is "
                                                           "not built yet"),
    (["prefill", "--pp-size", "2"], "--pp-size 2 cannot be combined with --disaggregation-mode"),
], ids=["cp2-decode", "layer-split-decode", "pp2-prefill"])
def test_unbuilt_layouts_refused_at_start_up(flags, message):
    """Before any model loads: exit code 2 and the layout named (the handshake refuses the rest: test_pd_layout.py)."""
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", "unused",
                           "--disaggregation-mode", *flags], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and message in done.stderr, done.stderr
