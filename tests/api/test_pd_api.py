"""Prefill/decode disaggregation over HTTP: 1 prefill + 1 decode tiny worker behind `radixserve route --prefill --decode`, against a colocated reference worker (C22, C24, C25, C26, C28). Every worker runs the glm45 reasoning parser (C26: a reasoning block opened by the handed-off first token)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import time

import httpx
import pytest

from radixserve.bench.launch import free_port
from radixserve.http_common import poller_limits
from tests.api.conftest import REPO, ServerProcess

SOAK = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "pd_soak.py"
WAIT_S = 60.0   # bound on waits for a state change (never a pass/fail timing)
COMMON = ["--max-total-tokens", "16384", "--page-size", "16", "--served-model-name", "tiny",
          "--enable-debug-endpoints", "--reasoning-parser", "glm45"]
PD_COUNTERS = ("radixserve:pd_transfer_bytes_total", "radixserve:pd_late_writes_refused_total",
               "radixserve:pd_late_writes_landed_total", "radixserve:pd_bootstrap_failures_total",
               "radixserve:pd_transfer_latency_seconds_count", "radixserve:pd_queue_time_seconds_count")


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def pd_fleet(tiny_model_dir):
    model = ["--model-path", str(tiny_model_dir)]
    ref = ServerProcess([*model, *COMMON, "--context-length", "1024", "--enable-fault-injection"])
    prefill = ServerProcess([*model, *COMMON, "--context-length", "512", "--disaggregation-mode",
                             "prefill", "--disaggregation-bootstrap-port", str(free_port()),
                             "--disaggregation-transfer-timeout", "10", "--enable-fault-injection"])
    decode = ServerProcess([*model, *COMMON, "--context-length", "1024", "--disaggregation-mode",
                            "decode", "--disaggregation-transfer-timeout", "10",
                            "--enable-fault-injection"])
    servers = [ref, prefill, decode]
    router = None
    try:
        for s in servers:
            s.wait_ready()
        for s in (prefill, decode):   # C-conventions: every PD counter is there, at 0, from start-up
            m = s.metrics()
            assert all(m[name] == 0 for name in PD_COUNTERS), {k: m.get(k) for k in PD_COUNTERS}
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "route", "--prefill", prefill.base_url, "--decode",
             decode.base_url, "--port", str(port), "--health-check-interval-s", "0.5",
             "--log-level", "warning"], cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(url + "/health"), "the router to be ready")
        yield ref, prefill, decode, httpx.Client(limits=poller_limits(), base_url=url, timeout=120)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for s in servers:
            s.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def completion(client, prompt, **kw) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0,
                                                "max_tokens": 8, **kw})


def test_parity_with_colocated(pd_fleet):
    ref, _, decode, router = pd_fleet
    prompts = [[100 + i for i in range(n)] for n in (1, 5, 15, 16, 17, 32, 48, 70)]
    prompts.append(prompts[-1][:48] + [9, 8, 7])   # hits the prefill worker's prefix cache
    for prompt in prompts:
        got = completion(router, prompt, logprobs=1)
        want = completion(ref.http, prompt, logprobs=1)
        assert got.status_code == 200, got.text
        g, w = got.json(), want.json()
        assert g["choices"][0]["text"] == w["choices"][0]["text"], len(prompt)
        assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"]
        lp_g, lp_w = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        assert lp_g["tokens"] == lp_w["tokens"]
        assert abs(lp_g["token_logprobs"][0] - lp_w["token_logprobs"][0]) < 1e-3
    assert g["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    m = decode.metrics()
    assert m["radixserve:pd_transfer_bytes_total"] > 0
    assert m["radixserve:pd_transfer_latency_seconds_count"] >= len(prompts)


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_counted_once(pd_fleet, stream):
    ref, _, _, router = pd_fleet
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1,
            "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        body.pop("stream_options")
    got = router.post("/v1/chat/completions", json=body)
    want = ref.post("/v1/chat/completions", json=body)
    assert got.status_code == 200, got.text
    if stream:
        g, w = _joined(got.text), _joined(want.text)
        assert g == w
        return
    g, w = got.json(), want.json()
    assert g["usage"]["completion_tokens"] == 1 == w["usage"]["completion_tokens"]
    assert g["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"] == "length"
    assert g["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"]
    lps = g["choices"][0]["logprobs"]["content"]
    assert len(lps) == 1 and len(lps[0]["top_logprobs"]) == 5
    assert abs(lps[0]["logprob"] - w["choices"][0]["logprobs"]["content"][0]["logprob"]) < 1e-3


@pytest.mark.parametrize("extra", [{"echo": True, "logprobs": 1, "max_tokens": 3},
                                   {"n": 2, "max_tokens": 4},
                                   {"max_tokens": 2, "stop_first": True}],
                         ids=["echo-logprobs", "n2", "stop-token-is-first"])
def test_first_token_handoff_cases(pd_fleet, extra):
    """C26: echo with prompt logprobs, n=2 (room per choice), a stop token that is the first
    token: byte-identical to the colocated worker."""
    ref, _, _, router = pd_fleet
    body = {"model": "tiny", "prompt": [300 + i for i in range(21)], "temperature": 0, **extra}
    if body.pop("stop_first", False):
        body["stop_token_ids"] = [_first_id(ref, body["prompt"])]
    got, want = router.post("/v1/completions", json=body), ref.post("/v1/completions", json=body)
    assert got.status_code == 200, got.text
    g, w = got.json(), want.json()
    assert [c["text"] for c in g["choices"]] == [c["text"] for c in w["choices"]]
    assert [c["finish_reason"] for c in g["choices"]] == [c["finish_reason"] for c in w["choices"]]
    assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"]
    if body.get("echo"):
        lp_g, lp_w = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        assert lp_g["tokens"] == lp_w["tokens"]
        for a, b in zip(lp_g["token_logprobs"][1:], lp_w["token_logprobs"][1:]):
            assert abs(a - b) < 1e-3


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_completed_by_the_first_token(pd_fleet, stream):
    """C26: a stop string that the first token (sampled on prefill) completes ends the request
    there, as on the colocated worker: empty text, finish_reason stop, 1 completion token."""
    ref, _, _, router = pd_fleet
    prompt = [310 + i for i in range(19)]
    first = ref.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                               "temperature": 0}).json()["choices"][0]["text"]
    assert first, "the first token decodes to no text"
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 6, "stop": [first],
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    got, want = router.post("/v1/completions", json=body), ref.post("/v1/completions", json=body)
    assert got.status_code == 200, got.text
    assert _completion_view(got, stream) == _completion_view(want, stream)
    assert _completion_view(got, stream) == ("", "stop", 1)


def _completion_view(r: httpx.Response, stream: bool) -> tuple[str, str | None, int | None]:
    """(text, finish_reason, completion_tokens) of a /v1/completions reply, streamed or not."""
    if not stream:
        c = r.json()["choices"][0]
        return c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]
    text, reason, usage = "", None, None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                text += c.get("text") or ""
                reason = c.get("finish_reason") or reason
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return text, reason, usage


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_block_opened_by_the_first_token(pd_fleet, default_tokenizer, stream):
    """C26: a reply whose first token (sampled on prefill, forced with sampler.force_tokens on
    every worker) opens the thinking block splits into the same reasoning_content and content,
    with the same completion_tokens and reasoning_tokens, through PD as on the colocated worker."""
    ref, prefill, decode, router = pd_fleet
    hf = default_tokenizer.hf
    ids = [*hf.encode("<think>\nIt is 4.\n</think>\n\nFour.", add_special_tokens=False),
           hf.convert_tokens_to_ids("<|im_end|>")]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 40,
            "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    views = []
    for target, servers in ((router, (prefill, decode)), (ref, (ref,))):
        for s in servers:
            r = s.post("/admin/fault", json={"kind": "sampler.force_tokens", "token_ids": ids,
                                             "count": 1})
            assert r.status_code == 200, r.text
        got = target.post("/v1/chat/completions", json=body)
        assert got.status_code == 200, got.text
        views.append(_chat_view(got, stream))
    thinking = len(hf.encode("<think>\nIt is 4.\n</think>", add_special_tokens=False))
    assert views[1] == ("It is 4.", "Four.", "stop", len(ids), thinking), views[1]   # colocated
    assert views[0] == views[1]


def _chat_view(r: httpx.Response, stream: bool) -> tuple:
    """(reasoning_content, content, finish_reason, completion_tokens, reasoning_tokens) of a
    chat reply."""
    if not stream:
        c, usage = r.json()["choices"][0], r.json()["usage"]
        return (c["message"].get("reasoning_content"), c["message"]["content"], c["finish_reason"],
                usage["completion_tokens"], usage["completion_tokens_details"]["reasoning_tokens"])
    reasoning, content, reason, usage = "", "", None, {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
                reason = c.get("finish_reason") or reason
            if event.get("usage"):
                usage = event["usage"]
    return (reasoning, content, reason, usage.get("completion_tokens"),
            usage.get("completion_tokens_details", {}).get("reasoning_tokens"))


def _first_id(server, prompt: list[int]) -> int:
    """The first token id the colocated worker generates for `prompt` (greedy)."""
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                             "stream": True, "return_token_ids": True})
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            ids = json.loads(line[6:])["choices"][0].get("token_ids")
            if ids:
                return ids[0]
    raise AssertionError(f"no token ids in {r.text[:500]}")


def _joined(sse: str) -> tuple[str, int | None]:
    text, usage = "", None
    for line in sse.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                text += c["delta"].get("content") or ""
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return text, usage


@pytest.mark.parametrize("stream", [False, True])
def test_failed_transfer_is_an_error_and_the_pair_recovers(pd_fleet, stream):
    _, prefill, decode, router = pd_fleet
    r = prefill.post("/admin/fault", json={"kind": "pd.transfer.write", "action": "fail", "count": 1})
    assert r.status_code == 200, r.text
    got = completion(router, list(range(200, 240)), stream=stream)
    assert got.status_code == 500, got.text      # never 200 with text (C24)
    assert got.json()["error"]["code"] == "kv_transfer_failed"
    ok = completion(router, list(range(200, 240)), stream=stream)   # not poisoned (C25)
    assert ok.status_code == 200, ok.text
    wait_for(lambda: decode.pages()["num_in_use_pages"] == 0, "decode pages back")


def test_hung_transfer_times_out_as_an_error_and_pages_wait_for_the_ack(pd_fleet):
    """C24: writes that hang end the request with a 5xx after the decode worker's transfer
    timeout (10 s here); its pages stay quarantined until the writes drain and the prefill
    side answers safe-to-free."""
    _, prefill, decode, router = pd_fleet
    r = prefill.post("/admin/fault", json={"kind": "pd.transfer.write", "action": "hang", "count": 3})
    assert r.status_code == 200, r.text
    try:
        got = completion(router, list(range(400, 460)))
        assert got.status_code == 500, got.text
        assert "timed out" in got.json()["error"]["message"]
        wait_for(lambda: decode.stats()["pd"]["num_quarantined_pages"] > 0
                 or decode.pages()["num_in_use_pages"] == 0, "the timeout to be handled")
    finally:
        assert prefill.http.delete("/admin/fault", params={"kind": "pd.transfer.write"}).status_code == 200
    wait_for(lambda: decode.stats()["pd"]["num_quarantined_pages"] == 0
             and decode.pages()["num_in_use_pages"] == 0, "the ack to free the pages")
    assert decode.metrics()["radixserve:pd_late_writes_landed_total"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_rejection_reaches_client_and_decode_leg_is_cancelled(pd_fleet, stream):
    _, prefill, decode, router = pd_fleet
    got = completion(router, [5] * 600, stream=stream)   # over prefill's 512, under decode's 1024
    assert got.status_code == 400, got.text
    assert got.json()["error"]["code"] == "context_length_exceeded"
    wait_for(lambda: decode.pages()["num_in_use_pages"] == 0
             and decode.stats()["pd"]["num_quarantined_pages"] == 0, "decode leg cleaned up")
    wait_for(lambda: prefill.stats()["pd"]["num_rooms"] == 0, "prefill bootstrap entry gone")


def test_layout_mismatch_fails_fast_naming_both_values(pd_fleet, tiny_model_dir):
    _, prefill, _, _ = pd_fleet
    other = ServerProcess(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096",
                           "--page-size", "32", "--disaggregation-mode", "decode"]).wait_ready()
    try:
        port = prefill.get("/get_server_info").json()["bootstrap_address"].rsplit(":", 1)[1]
        r = other.post("/v1/completions", timeout=10, json={
            "prompt": [1, 2, 3], "max_tokens": 2, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": int(port), "bootstrap_room": 77})
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert "page_size" in message and "16" in message and "32" in message, message
    finally:
        other.stop()


def test_scaled_down_soak(pd_fleet):
    """benchmarks/pd_soak.py at CI size: 300 verifiable prompts at concurrency 16 under random
    PD delays and 10 % client aborts; 0 corrupted, 0 cross-talk, 0 leaks, no 5xx."""
    ref, prefill, decode, router = pd_fleet
    spec = importlib.util.spec_from_file_location("pd_soak", SOAK)
    pd_soak = importlib.util.module_from_spec(spec)
    sys.modules["pd_soak"] = pd_soak   # its dataclasses look their module up
    spec.loader.exec_module(pd_soak)
    report = pd_soak.soak(str(router.base_url).rstrip("/"), ref.base_url, prefill.base_url,
                          decode.base_url, num_requests=300, concurrency=16, max_tokens=8,
                          abort_within_s=0.5, max_delay_ms=30.0, seed=14, words=(10, 60))
    assert report["ok"], json.dumps(report, indent=1)
    assert report["check"]["compared"] + report["aborted"] == 300, report
    assert report["aborted"] > 0


def test_no_leaks_and_no_tracebacks(pd_fleet):
    ref, prefill, decode, router = pd_fleet
    for s in (prefill, decode):
        wait_for(lambda s=s: s.pages()["num_in_use_pages"] == 0, "idle pages")
        s.assert_no_leak()
        s.assert_no_tracebacks()


def _stream_text_and_ids(r: httpx.Response) -> tuple[str, list[int], int | None]:
    assert r.status_code == 200, r.text
    text, ids, usage = "", [], None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                text += c.get("text") or ""
                ids += c.get("token_ids") or []
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return text, ids, usage


def test_a_stream_continuation_through_a_pair_equals_the_colocated_one(pd_fleet):
    """What the router sends when it continues a cut stream on another pair (router/pd.py): the
    request with resume_token_ids = the tokens the client has. The prefill worker computes the
    prompt and those tokens and samples the next; decode goes on. The rest equals a colocated
    worker's continuation and the uncut greedy run, token for token, with usage counting every
    completion token once."""
    ref, _, decode, router = pd_fleet
    prompt = list(range(300, 340))
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    _, uncut, _ = _stream_text_and_ids(ref.post("/v1/completions", json=body))
    assert len(uncut) == 12
    resumed = {**body, "resume_token_ids": uncut[:5]}
    want_text, want, want_usage = _stream_text_and_ids(ref.post("/v1/completions", json=resumed))
    got_text, got, got_usage = _stream_text_and_ids(router.post("/v1/completions", json=resumed))
    assert got == want == uncut[5:]
    assert got_text == want_text and got_usage == want_usage == 12
    wait_for(lambda: decode.pages()["num_in_use_pages"] == 0, "decode pages back")
