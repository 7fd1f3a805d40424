"""Fault injection (/admin/fault) and the output-anomaly guard through a real tiny-model worker
(the guard acting: --anomaly-guard-action abort; n-gram speculation and the acceptance detector
acting too, judging after 40 tokens: the random model
drafts only where its output is forced to repeat, so the other tests never reach it; KV
checksums on, checking every step, so every test here also shows they raise no false alarm)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.api.conftest import TINY_CONTEXT, start_tiny_server

WAIT_S = 60.0   # generous: only to avoid hanging a broken run, never a pass/fail threshold
KIND_OF_MODE = {"garble": "garbled", "repeat": "repetition", "noise": "rare_chars"}


@pytest.fixture(scope="module")
def server(request):
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT),
                                         "--max-total-tokens", "16384", "--page-size", "16",
                                         "--enable-debug-endpoints", "--enable-fault-injection",
                                         "--speculative-algorithm", "ngram",
                                         "--anomaly-guard-action", "abort",
                                         "--speculative-anomaly-action", "abort",
                                         "--speculative-anomaly-min-tokens", "40",
                                         "--speculative-anomaly-min-verify-steps", "8",
                                         "--speculative-anomaly-min-accept-length", "1.5",
                                         "--enable-kv-checksum", "--kv-checksum-interval", "1"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_faults_left(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").http.delete("/admin/fault")


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"gave up waiting for {what}")


def inject(server, **body) -> dict:
    r = server.post("/admin/fault", json=body)
    assert r.status_code == 200, r.text
    return r.json()["fault"]


def faults(server) -> dict[str, dict]:
    r = server.get("/admin/fault")
    assert r.status_code == 200, r.text
    return {f["kind"]: f for f in r.json()["faults"]}


def anomalies(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = server.get("/metrics").text
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "radixserve:num_anomalies_total"}


def rss(server) -> float:
    return server.metrics()["process_resident_memory_bytes"]


def completion(server, stream: bool = False, max_tokens: int = 64) -> httpx.Response:
    return server.post("/v1/completions", json={"model": server.model, "prompt": "Tell me",
                                                "max_tokens": max_tokens, "ignore_eos": True,
                                                "stream": stream})


def no_pages_in_use(server) -> bool:
    p = server.pages()
    return p["invariant_holds"] and p["num_in_use_pages"] == 0 and p["num_running"] == 0


def test_fault_routes_are_404_without_the_flag(tiny_server):
    for method in ("GET", "POST", "DELETE"):
        r = tiny_server.http.request(method, "/admin/fault", json={"kind": "hang"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == "not_found_error"


def test_inject_list_validate_and_clear(server):
    got = inject(server, kind="step_latency", latency_ms=5, jitter_ms=2, duration_s=600)
    assert got["kind"] == "step_latency" and got["latency_ms"] == 5 and got["jitter_ms"] == 2
    inject(server, kind="first_token_latency", latency_ms=10)
    listed = faults(server)
    assert set(listed) == {"step_latency", "first_token_latency"}
    assert listed["first_token_latency"]["remaining_s"] is None
    assert 0 < listed["step_latency"]["remaining_s"] <= 600
    assert completion(server, max_tokens=4).status_code == 200   # slowed, still served
    for bad in ({"kind": "fail", "latency_ms": 3}, {"kind": "step_latency"},
                {"kind": "explode"}, {"kind": "corrupt", "mode": "shout"},
                {"kind": "fail", "fraction": 2}, {"kind": "hang", "duration_s": -1}):
        r = server.post("/admin/fault", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
    assert server.http.delete("/admin/fault", params={"kind": "step_latency"}).json() == {
        "cleared": ["step_latency"]}
    assert set(faults(server)) == {"first_token_latency"}
    assert server.http.delete("/admin/fault").json() == {"cleared": ["first_token_latency"]}
    assert faults(server) == {}


BASE = {"duration_s": {"kind": "fail", "fraction": 0}, "latency_ms": {"kind": "step_latency"},
        "jitter_ms": {"kind": "step_latency", "latency_ms": 1}, "fraction": {"kind": "fail"},
        "mb_per_s": {"kind": "leak_memory"}, "max_mb": {"kind": "leak_memory", "mb_per_s": 1}}


@pytest.mark.parametrize("param", sorted(BASE))
def test_every_number_param_must_be_a_finite_json_number(server, param):
    """Infinity/NaN/1e400 used to be installed and then 500 every JSON reply (GET included);
    "5" and true used to be coerced to numbers. Each is a 400 naming the param, nothing set."""
    for value in ("Infinity", "-Infinity", "NaN", "1e400", '"5"', "true", "[1]"):
        raw = json.dumps(BASE[param])[:-1] + f', "{param}": {value}}}'
        r = server.post("/admin/fault", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, raw
        if value in ("Infinity", "-Infinity", "NaN", "1e400"):
            assert "finite" in error["message"], error
        assert faults(server) == {}, raw          # GET answers, and nothing was installed
    assert inject(server, **BASE[param], **{param: 1})[param] == 1   # a JSON int is a number


def partial_upload(server, path: str) -> None:
    """Send the headers and a part of the declared body, then close the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 100\r\n\r\n{\"model\":".encode())


def test_a_client_leaving_mid_upload_is_not_an_error(server):
    """starlette's ClientDisconnect from request.body() is the ordinary disconnect path (499,
    no ERROR line, no traceback), on the OpenAI routes and the admin ones alike."""
    for path in ("/v1/completions", "/v1/chat/completions", "/admin/fault"):
        partial_upload(server, path)
    assert server.get("/health").status_code == 200      # the server went on serving
    deadline = time.monotonic() + 1.0   # the disconnect is handled at once; give it a moment
    while time.monotonic() < deadline and "unhandled error" not in server.output():
        time.sleep(0.05)
    server.assert_no_tracebacks()
    assert completion(server, max_tokens=2).status_code == 200


def test_fail_gives_500_bodies_and_frees_pages(server):
    inject(server, kind="fail", fraction=1.0)
    for stream in (False, True):
        r = completion(server, stream=stream)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "injected_fault"
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert r.status_code == 500 and r.json()["error"]["code"] == "injected_fault"
    wait_for(lambda: no_pages_in_use(server), "pages of failed requests to be freed")
    server.assert_no_leak()


def test_fault_expires_after_its_duration(server):
    inject(server, kind="fail", fraction=1.0, duration_s=0.5)
    wait_for(lambda: faults(server) == {}, "the fail fault to expire")
    assert completion(server, max_tokens=2).status_code == 200


def test_force_tokens_emits_the_sequence_for_count_requests(server, default_tokenizer):
    """sampler.force_tokens: the next `count` requests emit exactly the ids (logprob 0.0 each),
    then finish by the usual checks; the request after them samples again."""
    hf = default_tokenizer.hf
    ids = hf.encode("The answer is 42.", add_special_tokens=False)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    inject(server, kind="sampler.force_tokens", token_ids=[*ids, end], count=3)
    body = {"model": server.model, "prompt": "Tell me", "max_tokens": len(ids), "logprobs": 1}
    full = server.post("/v1/completions", json=body).json()
    assert full["choices"][0]["text"] == "The answer is 42."
    assert full["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * len(ids)
    assert full["choices"][0]["finish_reason"] == "length"
    streamed = completion(server, stream=True, max_tokens=len(ids)).text
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
                   if line.startswith("data: {")) == "The answer is 42."
    stopped = server.post("/v1/completions", json={**body, "max_tokens": 50}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"   # <|im_end|> is an eos id
    assert stopped["usage"]["completion_tokens"] == len(ids) + 1
    assert stopped["choices"][0]["text"] == "The answer is 42."
    after = server.post("/v1/completions", json=body).json()["choices"][0]
    assert any(lp < 0 for lp in after["logprobs"]["token_logprobs"])   # sampled again
    server.http.delete("/admin/fault", params={"kind": "sampler.force_tokens"})


def test_force_tokens_with_bad_ids_is_400(server):
    for bad in ({"kind": "sampler.force_tokens"}, {"kind": "sampler.force_tokens", "token_ids": []},
                {"kind": "sampler.force_tokens", "token_ids": [49152]},
                {"kind": "sampler.force_tokens", "token_ids": [1], "count": 0},
                {"kind": "sampler.force_tokens", "token_ids": [2**63]},
                {"kind": "fail", "count": 2}):
        r = server.post("/admin/fault", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
    assert "sampler.force_tokens" not in faults(server)
    assert completion(server, max_tokens=2).status_code == 200


def test_hang_stops_every_route_until_cleared(server):
    inject(server, kind="hang")
    for path in ("/health", "/metrics", "/v1/models"):
        with pytest.raises(httpx.ReadTimeout):
            server.get(path, timeout=1.0)
    assert set(faults(server)) == {"hang"}          # /admin/fault still answers
    server.http.delete("/admin/fault")
    assert server.get("/health").status_code == 200
    server.assert_alive()


def test_leak_memory_grows_resident_memory_until_cleared(server):
    base = rss(server)
    inject(server, kind="leak_memory", mb_per_s=200, max_mb=300)
    wait_for(lambda: rss(server) > base + 250e6, "resident memory to grow by 250 MB")
    server.http.delete("/admin/fault")
    wait_for(lambda: rss(server) < base + 100e6, "the leaked memory to be freed")


@pytest.mark.parametrize("mode", sorted(KIND_OF_MODE))
def test_corrupt_output_is_caught_by_the_guard(server, mode):
    kind = KIND_OF_MODE[mode]
    before = anomalies(server)
    inject(server, kind="corrupt", mode=mode)
    r = completion(server)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "output_anomaly"
    assert r.json()["error"]["code"] == "output_anomaly"
    assert kind in r.json()["error"]["message"]
    after = anomalies(server)
    assert after[kind] == before[kind] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    wait_for(lambda: no_pages_in_use(server), "pages of the stopped request to be freed")
    server.assert_no_leak()


def test_greedy_repetition_is_not_stopped(server):
    """Under greedy decoding a loop is the model's deterministic answer: the forced loop
    reaches the client (and shows that corruption alters what clients get)."""
    from radixserve.server.anomaly import GuardConfig, RepetitionDetector
    from radixserve.server.tracker import ChoiceUpdate
    inject(server, kind="corrupt", mode="repeat")
    r = server.post("/v1/completions", json={"model": server.model, "prompt": "Tell me",
                                             "max_tokens": 64, "ignore_eos": True,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert RepetitionDetector(GuardConfig()).feed(ChoiceUpdate(0, text)) is not None


def test_streamed_corruption_ends_with_an_error_event(server):
    inject(server, kind="corrupt", mode="noise")
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64, "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "output_anomaly" and error["code"] == "output_anomaly"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]
                if c.get("finish_reason")]
    assert finishes == ["abort"]


def test_guard_is_quiet_on_ordinary_tiny_model_output(server):
    """Sampled (temperature 1) output of the random model is token soup, not an anomaly."""
    before = anomalies(server)
    for _ in range(6):
        r = server.post("/v1/completions", json={"model": server.model, "prompt": "Once",
                                                 "max_tokens": 128, "ignore_eos": True, "n": 2})
        assert r.status_code == 200, r.text
    assert anomalies(server) == before


def engine_stats(server) -> dict:
    r = server.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()["engine"]


def test_kv_checksum_stops_a_stream_whose_kv_was_overwritten(server):
    """(swap, which needs two requests running at once, is tested on the engine:
    tests/model/test_kv_checksum.py)"""
    seen = anomalies(server)["kv_checksum"]
    inject(server, kind="kv_corrupt", mode="noise", fraction=0.5, after_tokens=4)
    r = completion(server, stream=True, max_tokens=32)
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["type"] == "output_anomaly", errors
    assert "kv_checksum" in errors[0]["message"]
    assert anomalies(server)["kv_checksum"] == seen + 1
    wait_for(lambda: no_pages_in_use(server), "pages to be freed")


def test_kv_corrupt_hits_one_running_request_and_frees_its_pages(server):
    before = engine_stats(server)["num_kv_corruptions"]
    inject(server, kind="kv_corrupt", mode="noise", fraction=1.0, after_tokens=4)
    assert faults(server)["kv_corrupt"]["after_tokens"] == 4
    r = completion(server, max_tokens=16)
    assert r.status_code == 500 and r.json()["error"]["type"] == "output_anomaly", r.text
    assert "kv_checksum" in r.json()["error"]["message"]
    assert engine_stats(server)["num_kv_corruptions"] == before + 1
    assert completion(server, max_tokens=16).status_code == 200     # count 1: spent
    assert engine_stats(server)["num_kv_corruptions"] == before + 1
    wait_for(lambda: no_pages_in_use(server), "pages to be freed")
    for bad in ({"kind": "kv_corrupt"}, {"kind": "kv_corrupt", "mode": "garble"},
                {"kind": "kv_corrupt", "mode": "noise", "fraction": 0},
                {"kind": "kv_corrupt", "mode": "noise", "after_tokens": -1},
                {"kind": "kv_corrupt", "mode": "noise", "token_ids": [1]},
                {"kind": "corrupt", "mode": "swap"}):
        r = server.post("/admin/fault", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad


def test_usage_and_metrics_report_speculative_acceptance(server, default_tokenizer):
    """The random model never repeats itself, so its output is forced to repeat the prompt
    (sampler.force_tokens): the 3-gram proposer then drafts every step; the random model
    rejects most drafts, and the counts must add up either way."""
    ids = default_tokenizer.hf.encode(" one two three" * 12, add_special_tokens=False)
    inject(server, kind="sampler.force_tokens", token_ids=ids, count=1)
    m0 = server.metrics()
    r = server.post("/v1/completions", json={"model": server.model, "prompt": " one two three" * 2,
                                             "max_tokens": len(ids), "temperature": 0})
    assert r.json()["choices"][0]["text"] == " one two three" * 12
    usage = r.json()["usage"]
    steps, drafted, accepted = (usage["spec_verify_steps"], usage["spec_draft_tokens"],
                                usage["spec_accepted_tokens"])
    assert steps > 0 and drafted >= steps and 0 <= accepted <= drafted
    assert usage["spec_accept_length"] == round((accepted + steps) / steps, 4)
    assert usage["spec_accept_rate"] == round(accepted / drafted, 4)
    m1 = server.metrics()
    count = "radixserve:spec_accept_length_count"
    assert m1[count] == m0.get(count, 0) + 1
    drafts = "radixserve:spec_draft_tokens_by_position_total"   # the last position's sample
    assert m1[drafts] >= m0.get(drafts, 0)
    plain = server.post("/v1/completions", json={"model": server.model, "prompt": "Once",
                                                 "max_tokens": 1}).json()["usage"]
    assert not any(k.startswith("spec_") for k in plain)   # no verify step, no extra fields


def test_bench_check_output_finds_injected_kv_corruption(server, tmp_path):
    """The soak measure end to end: a clean greedy run saved, the same run compared with it
    (nothing differs), then again with every request's KV overwritten after 4 tokens: each
    damaged output is reported with its first differing token and that token's top-2 gap."""
    from radixserve.bench.cli import main as bench

    ref, out = tmp_path / "ref.jsonl", tmp_path / "runs.jsonl"
    args = ["--base-url", server.base_url, "--tokenizer", server.get("/server_info").json()["model_path"],
            "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "48",
            "--random-output-len", "16", "--ignore-eos", "--max-concurrency", "3",
            "--disable-progress", "--warmup-requests", "0", "--output-file", str(out)]
    assert bench([*args, "--save-output", str(ref)]) == 0
    assert bench([*args, "--check-output", str(ref)]) == 0
    clean = json.loads(out.read_text().splitlines()[-1])["check_output"]
    assert clean["compared"] == 6 and clean["corrupted"] == 0
    inject(server, kind="kv_corrupt", mode="noise", fraction=1.0, after_tokens=4, count=6)
    assert bench([*args, "--check-output", str(ref)]) == 0
    hurt = json.loads(out.read_text().splitlines()[-1])["check_output"]
    assert hurt["corrupted"] + hurt["guard_abort"] >= 1
    assert all(e["position"] >= 4 for e in hurt["first_corrupted"])
    wait_for(lambda: no_pages_in_use(server), "pages to be freed")


def test_collapsed_acceptance_stops_the_request(server, default_tokenizer):
    """Forced to repeat its prompt, the request drafts every step, and the random model rejects
    the drafts: after 40 tokens and 8 verify steps its accept length is under the 1.5 this worker
    was given, and the guard ends it as it ends garbled text."""
    ids = default_tokenizer.hf.encode(" one two three" * 20, add_special_tokens=False)
    inject(server, kind="sampler.force_tokens", token_ids=ids, count=1)
    before = anomalies(server)
    r = server.post("/v1/completions", json={"model": server.model, "prompt": " one two three" * 2,
                                             "max_tokens": len(ids), "temperature": 0})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "output_anomaly"
    assert "spec_acceptance" in r.json()["error"]["message"]
    assert anomalies(server)["spec_acceptance"] == before.get("spec_acceptance", 0) + 1
    wait_for(lambda: no_pages_in_use(server), "pages of the stopped request to be freed")
