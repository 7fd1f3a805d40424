"""--anomaly-guard-action through a real tiny-model worker and the openai client: output the client
asked for (logit_bias forcing lone UTF-8 byte tokens, U+FFFD text the garbled detector fires on) is a
200 with that text under both actions, counted as a report; the garble fault on an unconstrained
request is reported under `report` and stops the request under `abort`; collapsed n-gram
acceptance is only reported (docs/anomaly_guard.md)."""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import TINY_CONTEXT, start_tiny_server

BYTE_TOKEN = 111     # a lone UTF-8 byte in the default tokenizer: decodes to U+FFFD
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=["report", "abort"])
def server(request):
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT),
                                         "--max-total-tokens", "8192", "--page-size", "16",
                                         "--enable-fault-injection",
                                         "--anomaly-guard-action", request.param])
    server.action = request.param
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_faults_left(request):
    yield
    for name in ("server", "ngram_server"):
        if name in request.fixturenames:
            request.getfixturevalue(name).http.delete("/admin/fault")


def detections(server) -> dict[tuple[str, str], float]:
    text = server.get("/metrics").text
    return {(s.labels["kind"], s.labels["action"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "radixserve:anomaly_detections_total"}


def added(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_logit_bias_forcing_byte_tokens_is_a_200_with_the_forced_text(server, default_tokenizer):
    before = detections(server)
    out = server.client().completions.create(
        model=server.model, prompt="Say something", max_tokens=MAX_TOKENS, temperature=0.8,
        logit_bias={str(BYTE_TOKEN): 100})
    text = out.choices[0].text
    assert text == default_tokenizer.decode([BYTE_TOKEN] * MAX_TOKENS) and "\ufffd" in text
    assert out.choices[0].finish_reason == "length"
    assert added(before, detections(server)) == {("garbled", "report"): 1.0}


def test_a_forced_chat_stream_ends_normally(server, default_tokenizer):
    before = detections(server)
    stream = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
        logit_bias={str(BYTE_TOKEN): 100}, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == default_tokenizer.decode([BYTE_TOKEN] * MAX_TOKENS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert added(before, detections(server)) == {("garbled", "report"): 1.0}


def test_the_action_decides_for_an_unconstrained_request(server):
    r = server.post("/admin/fault", json={"kind": "corrupt", "mode": "garble"})
    assert r.status_code == 200, r.text
    before = detections(server)
    body = {"model": server.model, "prompt": "Tell me", "max_tokens": 64,
            "extra_body": {"ignore_eos": True}}
    if server.action == "report":
        out = server.client().completions.create(**body)
        assert out.choices[0].finish_reason == "length"
        assert added(before, detections(server)) == {("garbled", "report"): 1.0}
        return
    with pytest.raises(openai.InternalServerError) as err:
        server.client().completions.create(**body)
    error = json.loads(err.value.response.text)["error"]
    assert error["type"] == "output_anomaly" and error["anomaly_kind"] == "garbled"
    assert added(before, detections(server)) == {("garbled", "abort"): 1.0}


@pytest.fixture(scope="module")
def ngram_server(request):
    """Default actions, n-gram speculation, the acceptance rule judging after 40 tokens (as
    test_faults.py, where it acts)."""
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT),
                                         "--max-total-tokens", "8192", "--enable-fault-injection",
                                         "--speculative-algorithm", "ngram",
                                         "--speculative-anomaly-min-tokens", "40",
                                         "--speculative-anomaly-min-verify-steps", "8",
                                         "--speculative-anomaly-min-accept-length", "1.5"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def test_collapsed_n_gram_acceptance_is_only_reported(ngram_server, default_tokenizer):
    """The request test_faults.py's worker stops (forced to repeat its prompt, the random model
    rejecting the n-gram drafts): with an n-gram draft `auto` only reports it."""
    server = ngram_server
    ids = default_tokenizer.hf.encode(" one two three" * 20, add_special_tokens=False)
    r = server.post("/admin/fault", json={"kind": "sampler.force_tokens", "token_ids": ids, "count": 1})
    assert r.status_code == 200, r.text
    before = detections(server)
    out = server.client().completions.create(model=server.model, prompt=" one two three" * 2,
                                             max_tokens=len(ids), temperature=0)
    assert out.choices[0].text == " one two three" * 20
    assert added(before, detections(server)) == {("spec_acceptance", "report"): 1.0}
