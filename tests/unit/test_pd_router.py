"""The router's PD dispatch over mock workers: when one leg fails the other is cancelled, not awaited (C28); a prefill 4xx reaches the client; a stream is committed only at decode's first event; a retryable failure is retried on another pair within the budget."""
from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import httpx
import pytest

from radixserve.router.outcome import classify
from radixserve.router.pd import PDRouter

P, D = "http://prefill:1", "http://decode:2"


class Registry:
    def __init__(self, urls):
        self.workers = [SimpleNamespace(url=u, streams=set()) for u in urls]
        self.in_flight = 0

    def routable(self, exclude=frozenset()):
        return [w for w in self.workers if w.url not in exclude]

    @contextlib.contextmanager
    def dispatch(self, worker):
        self.in_flight += 1
        try:
            yield worker
        finally:
            self.in_flight -= 1


class Count:
    def __init__(self):
        self.value = 0
        self.by_label: dict[str, int] = {}

    def inc(self):
        self.value += 1

    def labels(self, *labels):
        counter, label = self, labels[0] if len(labels) == 1 else labels
        return SimpleNamespace(inc=lambda: counter.by_label.__setitem__(label, counter.by_label.get(label, 0) + 1))


class Forwarder:
    """The router Forwarder's part PD mode uses: the retry budget, backoff and breaker records."""

    def __init__(self, attempts, migrations, anomalies):
        self.max_attempts = attempts
        self.outcomes: list[tuple[str, str]] = []
        self.migration_on = True
        self.metrics = SimpleNamespace(migrations=migrations, anomalies=anomalies)

    def backoff_s(self, retry):
        return 0.0

    def record(self, worker, status, transport_error, kind=None):
        self.outcomes.append((worker.url, classify(status, transport_error, kind).breaker))


def side(urls, http, attempts):
    policy = SimpleNamespace(select=lambda key, cands: SimpleNamespace(worker=cands[0]))
    migrations, anomalies = Count(), Count()
    return SimpleNamespace(registry=Registry(urls), policy=policy, http=http,
                           config=SimpleNamespace(connect_timeout_s=1.0, silence_timeout_s=30.0),
                           forwarder=Forwarder(attempts, migrations, anomalies),
                           metrics=SimpleNamespace(retries=Count(), retries_exhausted=Count(),
                                                   migrations=migrations, anomalies=anomalies))


def run(prefill_handler, decode_handler, body=None, prefill=(P,), decode=(D,), attempts=5):
    """Forward one request; returns (response status, body bytes, what the handlers saw).
    `seen` also gets "in_flight" (both registries after the request), "router" (the PDRouter)
    and "hosts" (every leg's worker host, in order)."""
    seen: dict[str, object] = {"hosts": []}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"disaggregation_mode": "prefill",
                                             "bootstrap_address": "tcp://127.0.0.1:8998"})
        seen["hosts"].append(request.url.host)
        fn = prefill_handler if request.url.host.startswith("prefill") else decode_handler
        return await fn(request, seen)

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        router = PDRouter(side(prefill, http, attempts), side(decode, http, attempts))
        seen["router"] = router
        resp = await asyncio.wait_for(router.forward(
            "/v1/completions", body or {"prompt": "hi", "max_tokens": 2}, {}, None,
            bool((body or {}).get("stream"))), 10)
        chunks = b""
        if hasattr(resp, "body_iterator"):
            async for chunk in resp.body_iterator:
                chunks += chunk
        else:
            chunks = resp.body
        await asyncio.sleep(0)   # let cancellations run
        seen["in_flight"] = (router.prefill.registry.in_flight, router.decode.registry.in_flight)
        await http.aclose()
        return resp.status_code, chunks
    status, data = asyncio.run(main())
    return status, data, seen


async def hang(request, seen):
    key = "prefill" if request.url.host.startswith("prefill") else "decode"
    seen[key + "_body"] = json.loads(request.content)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        seen[key + "_cancelled"] = True
        raise


async def reset(request, seen):
    raise httpx.ConnectError("connection reset")


async def chunks(parts):
    """A streamed body (a worker's SSE events, one network read each)."""
    for part in parts:
        yield part


async def prefill_ok(request, seen):
    seen["prefill_body"] = json.loads(request.content)
    return httpx.Response(200, json={"choices": [{"text": "x"}]})


def test_decode_transport_failure_cancels_the_prefill_leg():
    status, data, seen = run(hang, reset)
    assert status == 502 and b"decode" in data
    assert seen.get("prefill_cancelled"), seen
    assert seen["in_flight"] == (0, 0)


def test_prefill_error_cancels_the_decode_leg_and_reaches_the_client():
    async def too_long(request, seen):
        return httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error",
                                                   "code": "context_length_exceeded"}})
    status, data, seen = run(too_long, hang, prefill=(P, "http://prefill-b:1"))
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"
    assert seen.get("decode_cancelled"), seen
    assert seen["in_flight"] == (0, 0)
    assert seen["hosts"].count("prefill") == 1 and "prefill-b" not in seen["hosts"], "a 4xx is not retried"


def test_both_legs_share_the_bootstrap_room_and_prefill_is_not_streamed():
    async def decode_ok(request, seen):
        seen["decode_body"] = json.loads(request.content)
        events = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
        return httpx.Response(200, content=chunks(events), headers={"content-type": "text/event-stream"})
    status, data, seen = run(prefill_ok, decode_ok, {"prompt": "hi", "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    p, d = seen["prefill_body"], seen["decode_body"]
    assert p["bootstrap_room"] == d["bootstrap_room"] and p["bootstrap_port"] == 8998
    assert p["stream"] is False and "stream_options" not in p and d["stream"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_error_before_any_token_is_the_status(stream):
    error = {"error": {"message": "prefill/decode handoff failed", "type": "kv_transfer_failed",
                       "code": "kv_transfer_failed"}}

    async def decode_fails(request, seen):
        if stream:   # the worker said 200 at acceptance, then its first event is the error
            return httpx.Response(200, content=chunks([b"data: " + json.dumps(error).encode() + b"\n\n"]),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(500, json=error)
    status, data, _ = run(prefill_ok, decode_fails, {"prompt": "hi", "stream": stream})
    assert status == 500 and json.loads(data)["error"]["code"] == "kv_transfer_failed"


async def decode_ok(request, seen):
    seen.setdefault("decode_rooms", []).append(json.loads(request.content)["bootstrap_room"])
    return httpx.Response(200, json={"choices": [{"text": "ok"}]})


def test_a_busy_prefill_worker_is_retried_on_another_pair():
    async def busy_then_ok(request, seen):
        seen.setdefault("prefill_rooms", []).append(json.loads(request.content)["bootstrap_room"])
        if request.url.host == "prefill":
            return httpx.Response(503, json={"error": {"message": "queue full", "type": "server_overloaded"}})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    status, data, seen = run(busy_then_ok, decode_ok, prefill=(P, "http://prefill-b:1"))
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "ok"
    router = seen["router"]
    assert router.prefill.metrics.retries.value == 1
    assert router.prefill.forwarder.outcomes == [(P, "neutral"), ("http://prefill-b:1", "success")]
    assert router.decode.forwarder.outcomes == [(D, "success")]
    rooms = seen["prefill_rooms"]
    assert len(set(rooms)) == 2 and seen["decode_rooms"][-1] == rooms[-1], "each attempt has its own room"
    assert seen["in_flight"] == (0, 0)


def test_a_failed_decode_leg_is_retried_on_another_decode_worker_and_its_prefill_cancelled():
    async def prefill_waits_for_first_decode(request, seen):
        if "first_prefill" not in seen:
            seen["first_prefill"] = True
            return await hang(request, seen)
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    async def first_decode_resets(request, seen):
        if request.url.host == "decode":
            raise httpx.ConnectError("connection reset")
        return await decode_ok(request, seen)

    status, data, seen = run(prefill_waits_for_first_decode, first_decode_resets,
                             decode=(D, "http://decode-b:2"))
    assert status == 200
    assert seen.get("prefill_cancelled"), "the failed attempt's prefill leg was cancelled, not awaited"
    assert seen["router"].decode.forwarder.outcomes == [(D, "failure"), ("http://decode-b:2", "success")]
    assert seen["hosts"].count("prefill") == 2, "the prefill worker itself is tried again"
    assert seen["in_flight"] == (0, 0)


@pytest.mark.parametrize("attempts", [1, 2, 5])
def test_retries_stop_at_the_budget_and_the_last_error_is_the_answer(attempts):
    async def broken(request, seen):
        return httpx.Response(500, json={"error": {"message": f"broken {request.url.host}", "type": "internal_error"}})

    prefill = tuple(f"http://prefill-{i}:1" for i in range(3))
    status, data, seen = run(broken, hang, prefill=prefill, attempts=attempts)
    tried = min(attempts, len(prefill))
    assert status == 500 and json.loads(data)["error"]["message"] == f"broken prefill-{tried - 1}"
    router = seen["router"]
    assert sum(h.startswith("prefill") for h in seen["hosts"]) == tried
    assert router.prefill.metrics.retries.value == tried - 1
    assert router.prefill.metrics.retries_exhausted.value == 1
    assert [o for _, o in router.prefill.forwarder.outcomes] == ["failure"] * tried
    assert seen["in_flight"] == (0, 0)


def event(text, ids, finish=None):
    data = {"id": "cmpl-x", "created": 7, "choices": [{"index": 0, "text": text, "token_ids": ids,
                                                       "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def cut_after(events):
    """A stream that delivers `events`, then loses its connection."""
    for e in events:
        yield e
    raise httpx.ReadError("connection reset mid-stream")


def migrating_decode(first_events):
    """decode-a streams `first_events` and breaks; decode-b answers the continuation."""
    async def handler(request, seen):
        body = json.loads(request.content)
        seen.setdefault("decode_bodies", []).append(body)
        headers = {"content-type": "text/event-stream"}
        if request.url.host == "decode":
            return httpx.Response(200, content=cut_after(first_events), headers=headers)
        return httpx.Response(200, content=chunks([event("c", [3], "length"), b"data: [DONE]\n\n"]),
                              headers=headers)
    return handler


async def prefill_records(request, seen):
    seen.setdefault("prefill_bodies", []).append(json.loads(request.content))
    return httpx.Response(200, json={"choices": [{"text": "x"}]})


def test_a_stream_cut_after_content_is_continued_on_another_pair():
    """The decode worker dies after two tokens: the router resends the request with those
    tokens as resume_token_ids to both legs of a new pair (never the dead decode worker), and
    the client sees one stream: each token once, one id, no token ids it did not ask for."""
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    status, data, seen = run(prefill_records, migrating_decode([event("a", [1]), event("b", [2])]),
                             body, decode=(D, "http://decode-b:2"))
    assert status == 200
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in data.split(b"\n\n")
             if e.startswith(b"data: {")]
    assert texts == ["a", "b", "c"] and data.endswith(b"data: [DONE]\n\n")
    assert b"token_ids" not in data and data.count(b'"id":"cmpl-x"') == 3
    first, second = seen["decode_bodies"]
    assert first["return_token_ids"] is True and "resume_token_ids" not in first
    assert second["resume_token_ids"] == [1, 2]
    assert seen["prefill_bodies"][1]["resume_token_ids"] == [1, 2], "the new prefill computes them too"
    assert seen["prefill_bodies"][1]["bootstrap_room"] == second["bootstrap_room"] != first["bootstrap_room"]
    assert seen["hosts"] == ["prefill", "decode", "prefill", "decode-b"]
    router = seen["router"]
    assert router.prefill.metrics.migrations.by_label == {"success": 1}
    assert seen["in_flight"] == (0, 0)


def test_a_cut_stream_ends_with_an_error_event_when_no_pair_is_left():
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    status, data, seen = run(prefill_records, migrating_decode([event("a", [1])]), body)
    assert status == 200
    assert data.count(b'"text": "a"') + data.count(b'"text":"a"') == 1
    assert b'"worker_error"' in data and data.endswith(b"data: [DONE]\n\n")
    assert seen["router"].prefill.metrics.migrations.by_label == {"exhausted": 1}
    assert seen["hosts"] == ["prefill", "decode"], "the dead decode worker is not tried again"
    assert seen["in_flight"] == (0, 0)


@pytest.mark.parametrize("first", [b'data: {"error": "boom"}\n\n', b'data: {"error": {"message": "x"}} trailing\n\n'])
def test_a_malformed_error_event_before_content_is_a_retryable_failure(first):
    """Found by a bad-input pass: such an event raised out of the router (AttributeError /
    JSONDecodeError). It is a worker failure: retried on another decode worker."""
    async def decode(request, seen):
        headers = {"content-type": "text/event-stream"}
        if request.url.host == "decode":
            return httpx.Response(200, content=chunks([first, b"data: [DONE]\n\n"]), headers=headers)
        return httpx.Response(200, content=chunks([event("ok", [1], "stop"), b"data: [DONE]\n\n"]),
                              headers=headers)
    status, data, seen = run(prefill_records, decode, {"prompt": "hi", "stream": True},
                             decode=(D, "http://decode-b:2"))
    assert status == 200 and b'"ok"' in data and data.endswith(b"data: [DONE]\n\n")
    assert seen["hosts"] == ["prefill", "decode", "prefill", "decode-b"]
    assert seen["in_flight"] == (0, 0)


def test_a_stream_that_ends_early_without_done_is_continued():
    """A decode stream that closes cleanly after content but without `data: [DONE]` was cut
    short: it is continued like a broken one, not passed on as a complete answer."""
    async def decode(request, seen):
        body = json.loads(request.content)
        seen.setdefault("decode_bodies", []).append(body)
        headers = {"content-type": "text/event-stream"}
        if request.url.host == "decode":
            return httpx.Response(200, content=chunks([event("a", [1])]), headers=headers)
        return httpx.Response(200, content=chunks([event("b", [2], "stop"), b"data: [DONE]\n\n"]),
                              headers=headers)
    status, data, seen = run(prefill_records, decode, {"prompt": "hi", "stream": True},
                             decode=(D, "http://decode-b:2"))
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    assert status == 200 and texts == ["a", "b"] and data.endswith(b"data: [DONE]\n\n")
    assert seen["decode_bodies"][1]["resume_token_ids"] == [1]
    assert seen["in_flight"] == (0, 0)


def test_a_burst_of_first_requests_makes_one_bootstrap_lookup_that_may_be_slow():
    """16 requests arrive before the router knows the prefill worker's bootstrap address: one
    GET /get_server_info serves them all, and an answer slower than the connect timeout (the
    worker answers between engine steps) is no failure."""
    lookups = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            lookups.append(request.url.host)
            await asyncio.sleep(1.5)   # longer than connect_timeout_s (1.0)
            return httpx.Response(200, json={"disaggregation_mode": "prefill",
                                             "bootstrap_address": "tcp://0.0.0.0:8998"})
        if request.url.host.startswith("prefill"):
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        return httpx.Response(200, json={"choices": [{"text": "y"}]})

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        prefill, decode = side((P,), http, 1), side((D,), http, 1)
        router = PDRouter(prefill, decode)
        answers = await asyncio.wait_for(asyncio.gather(*(
            router.forward("/v1/completions", {"prompt": "hi", "max_tokens": 2}, {}, None, False)
            for _ in range(16))), 30)
        await http.aclose()
        return router, prefill, answers

    router, prefill, answers = asyncio.run(main())
    assert lookups == ["prefill"]
    assert [a.status_code for a in answers] == [200] * 16
    assert router._bootstrap[P] == ("prefill", 8998)   # 0.0.0.0: the worker's own host
    assert ("http://prefill:1", "failure") not in prefill.forwarder.outcomes


ANOMALY = (b'data: {"error": {"message": "looked broken", "type": "output_anomaly", "param": null, '
           b'"code": "output_anomaly", "anomaly_kind": "spec_acceptance"}}\n\n')


@pytest.mark.parametrize("after_content", [False, True])
def test_an_output_anomaly_is_retried_from_the_prompt_only_before_content(after_content):
    """Before any text (the worker's text-less "abort" chunk, then its error event) the request is
    retried on another pair from the prompt; after text the stream ends with the error event and
    is never continued from the tokens the worker's detector suspected."""
    first = [event("a", [1])] if after_content else []

    async def decode(request, seen):
        seen.setdefault("decode_bodies", []).append(json.loads(request.content))
        headers = {"content-type": "text/event-stream"}
        if request.url.host == "decode":
            return httpx.Response(200, content=chunks(
                [*first, event("", [], "abort"), ANOMALY, b"data: [DONE]\n\n"]), headers=headers)
        return httpx.Response(200, content=chunks([event("ok", [5], "stop"), b"data: [DONE]\n\n"]),
                              headers=headers)
    status, data, seen = run(prefill_records, decode, {"prompt": "hi", "stream": True},
                             decode=(D, "http://decode-b:2"))
    anomalies = seen["router"].prefill.metrics.anomalies.by_label
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    if after_content:
        assert b'"output_anomaly"' in data and b'"ok"' not in data
        assert seen["hosts"] == ["prefill", "decode"]
        assert anomalies == {("spec_acceptance", "ended"): 1}
    else:
        assert b'"ok"' in data and b"error" not in data and b'"abort"' not in data
        assert seen["hosts"] == ["prefill", "decode", "prefill", "decode-b"]
        assert "resume_token_ids" not in seen["decode_bodies"][1]
        assert anomalies == {("spec_acceptance", "retried"): 1}
    assert seen["in_flight"] == (0, 0)
