"""Hostile input to the whole router app (fake workers via httpx MockTransport): never a 500."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from radixserve.router.app import build_app
from radixserve.router.state import build_state
from radixserve.router.config import RouterConfig
from radixserve.router.proxy import Forwarder
from radixserve.router.validate import worker_url

W0, W1 = "http://w0:8000", "http://w1:8000"
ADMIN = {"Authorization": "Bearer adm"}
OK = {"choices": [{"text": "ok"}]}
NESTED = b"[" * 1000
BIG = "1" + "0" * 400  # a JSON integer beyond the float range


class FakeWorkers:
    """Answers every worker request; `seen` holds (url, raw path, raw headers) of each."""

    def __init__(self, reply_headers: list[tuple[bytes, bytes]] | None = None):
        self.seen: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        self.reply_headers = reply_headers or []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = {k.lower(): v for k, v in request.headers.raw}
        self.seen.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}",
                          request.url.raw_path, raw))
        path = request.url.path
        if path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        elif path in ("/health", "/get_server_info"):
            body = {}
        else:
            body = OK
        data = json.dumps(body).encode()
        kind = b"application/json"
        if request.method == "POST" and json.loads(request.content or b"{}").get("stream"):
            data, kind = b"data: " + data + b"\n\ndata: [DONE]\n\n", b"text/event-stream"
        # A stream, as from a real transport (content= would count as already read).
        return httpx.Response(200, stream=httpx.ByteStream(data),
                              headers=[(b"content-type", kind)] + self.reply_headers)

    def client_calls(self) -> list[bytes]:
        """Raw paths of what reached a worker other than health checks and load polls."""
        return [p for _, p, _ in self.seen if p not in (b"/health", b"/get_server_info")]


def run_router(scenario, workers: FakeWorkers | None = None, urls=(W0, W1), **config):
    """Run `scenario(client, state, workers)` against a router over fake workers at `urls`."""
    workers = workers or FakeWorkers()
    cfg = RouterConfig(policy="round_robin", retry_initial_backoff_ms=1, admin_api_key="adm",
                       worker_api_key="WORKERKEY", **config)
    state = build_state(cfg, list(urls))
    for worker in state.registry.list():
        worker.healthy = True

    async def main():
        await state.http.aclose()
        state.http = httpx.AsyncClient(transport=httpx.MockTransport(workers))
        state.monitor.http = state.http
        state.forwarder = Forwarder(cfg, state.registry, state.policy, state.metrics, state.http)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            try:
                return await scenario(client, state, workers)
            finally:
                await state.http.aclose()
    return asyncio.run(main())


def assert_error(r: httpx.Response, status: int, kind: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/drain",
                                  "/admin/add_worker", "/admin/set_policy_params"])
def test_deeply_nested_json_is_a_400(path):
    async def scenario(client, state, workers):
        r = await client.post(path, content=NESTED, headers={**ADMIN, "content-type": "application/json"})
        error = assert_error(r, 400, "invalid_request_error")
        assert "nested too deeply" in error["message"], error
        assert workers.client_calls() == []
    run_router(scenario)


def test_non_ascii_header_bytes_pass_through_unchanged():
    """A latin-1 byte in a forwarded header reaches the worker as sent, and the worker's
    relayed reply headers reach the client as sent (UTF-8 bytes included); POST, stream, GET."""
    echo = [(b"x-request-id", "\u20ac".encode())]  # a UTF-8 euro sign: beyond latin-1

    async def scenario(client, state, workers):
        sent = {"x-request-id": b"\xe9", "authorization": b"Bearer \xe9"}
        for stream in (False, True):
            r = await client.post("/v1/completions", headers=sent,
                                  json={"prompt": "hi", "stream": stream})
            assert r.status_code == 200, r.text
            if stream:  # a stream relays the worker's RELAYED_HEADERS
                assert dict(r.headers.raw)[b"x-request-id"] == "\u20ac".encode()
        r = await client.get("/v1/models", headers=sent)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        r = await client.get("/admin/workers", headers={"authorization": b"Bearer \xe9"})
        assert_error(r, 401, "authentication_error")
        forwarded = [h for _, p, h in workers.seen if p in (b"/v1/completions", b"/v1/models")]
        assert len(forwarded) == 3
        for headers in forwarded:
            assert headers[b"x-request-id"] == b"\xe9"
            assert headers[b"authorization"] == b"Bearer \xe9"
    run_router(scenario, FakeWorkers(echo))


@pytest.mark.parametrize("url", [
    "http://", "https://", "http://:80", "http://[::1", "http://127.0.0.1:abc",
    "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://a b", "http://h:1\n",
    "http://h:1?x=1", "http://h:1#frag", "http://h:1/v1", "http://user:pw@h:1", "ftp://h:1",
    "http://a..b:1", "h:1", "", 5, None])
def test_add_worker_rejects_urls_that_cannot_work(url):
    async def scenario(client, state, workers):
        r = await client.post("/admin/add_worker", json={"url": url}, headers=ADMIN)
        assert_error(r, 400, "invalid_request_error", param="url")
        assert [w.url for w in state.registry.list()] == [W0, W1]
    run_router(scenario)


def test_worker_urls_are_canonical_so_spellings_of_one_worker_are_duplicates():
    assert worker_url("HTTP://LocalHost:32100/") == "http://localhost:32100"
    assert worker_url("http://h") == "http://h:80" and worker_url("https://h") == "https://h:443"
    assert worker_url("http://[::1]:5") == "http://[::1]:5"
    with pytest.raises(ValueError):
        build_state(RouterConfig(), ["http://h:80", "http://H/"])
    assert [w.url for w in build_state(RouterConfig(), ["http://h/"]).registry.list()] == \
        ["http://h:80"]

    async def scenario(client, state, workers):
        for spelling in ("http://W0:8000/", "HTTP://w0:8000"):
            r = await client.post("/admin/add_worker", json={"url": spelling}, headers=ADMIN)
            assert_error(r, 400, "invalid_request_error", param="url")
        r = await client.post("/admin/add_worker", json={"url": "http://W2"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["url"] == "http://w2:80"
        # Any spelling finds the worker; the listed name works as given.
        r = await client.post("/admin/drain", json={"url": "http://w0:8000/"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["url"] == W0
        r = await client.post("/admin/remove_worker", json={"url": "http://w2:80"}, headers=ADMIN)
        assert r.status_code == 200
    run_router(scenario)


def test_a_worker_url_httpx_refuses_is_a_transport_failure_not_a_500():
    """Defence in depth: a URL that got past validation and that httpx refuses (InvalidURL)
    fails health checks and is skipped by the GET relay and by request forwarding."""
    async def scenario(client, state, workers):
        bad = state.registry.add("http://[::1", healthy=True)  # behind the validator's back
        state.registry.add(W0)
        assert await state.monitor.check(bad) is False
        await state.monitor.poll(bad)
        bad.healthy = True
        assert (await client.get("/v1/models")).status_code == 200  # bad one asked first
        for _ in range(2):  # round robin: one of the two goes to the bad worker first
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 200
        assert bad.num_failures >= 1  # counted as a transport failure, then retried
    run_router(scenario, urls=())


@pytest.mark.parametrize("path", ["/admin/fault", "/debug/pages", "/get_server_info",
                                  "/flush_cache", "/v1/models/a%2F..%2F..%2Fadmin%2Ffault"])
def test_get_relays_only_model_routes(path):
    async def scenario(client, state, workers):
        r = await client.get(path)
        if path.startswith("/v1/models/"):  # relayed, but as one segment under /v1/models/
            assert r.status_code == 200
            assert workers.client_calls() == [b"/v1/models/a%2F..%2F..%2Fadmin%2Ffault"]
        else:
            assert_error(r, 404, "not_found_error")
            assert workers.client_calls() == []
    run_router(scenario)


def test_router_worker_key_goes_on_health_checks_only():
    async def scenario(client, state, workers):
        await client.get("/v1/models")
        await client.post("/v1/completions", json={"prompt": "hi"})
        await client.get("/v1/models", headers={"Authorization": "Bearer client"})
        await state.monitor.check_all()
        await state.monitor.poll_all()
        auth = [(p, h.get(b"authorization")) for _, p, h in workers.seen]
        assert auth[:3] == [(b"/v1/models", None), (b"/v1/completions", None),
                            (b"/v1/models", b"Bearer client")]
        assert len(auth) == 7 and all(a == b"Bearer WORKERKEY" for _, a in auth[3:])
    run_router(scenario)


@pytest.mark.parametrize("path,body,param", [
    ("/admin/set_weight", {"url": W0, "weight": BIG}, "weight"),
    ("/admin/add_worker", {"url": "http://w2:1", "weight": BIG}, "weight"),
    ("/admin/set_policy_params", {"balance_rel_threshold": BIG}, "balance_rel_threshold"),
    ("/admin/set_policy_params", {"cache_threshold": "-" + BIG}, "cache_threshold"),
])
def test_integers_beyond_float_range_are_a_400(path, body, param):
    async def scenario(client, state, workers):
        raw = json.dumps(body).replace(f'"-{BIG}"', f"-{BIG}").replace(f'"{BIG}"', BIG)
        r = await client.post(path, content=raw.encode(), headers=ADMIN)
        error = assert_error(r, 400, "invalid_request_error", param=param)
        assert "must be a finite number" in error["message"]
        assert [w.weight for w in state.registry.list()] == [1.0, 1.0]
    run_router(scenario)


def test_oversized_admin_body_is_a_413_and_head_works():
    async def scenario(client, state, workers):
        r = await client.post("/admin/drain", headers=ADMIN,
                              json={"url": W0, "pad": "x" * (65 << 10)})
        assert_error(r, 413, "invalid_request_error")
        assert not state.registry.get(W0).draining
        for path in ("/health", "/v1/models"):
            assert (await client.head(path)).status_code == 200, path
    run_router(scenario)


EXCEPTION_WORDS = ("Error", "Exception", "object has no attribute", "Traceback", "KeyError")
ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", ROUTES + ["/admin/drain", "/admin/add_worker"])
@pytest.mark.parametrize("raw,says", [
    (b"{not json", "is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
    (b"", "is empty"),
    (b'{"prompt": "hi"', "is not valid JSON: Expecting ',' delimiter at line 1 column 16"),
    (b'{"prompt": "\xff\xfe"}', "is not valid UTF-8: byte 0xff at offset 12"),
    (b"[1, 2]", "must be a JSON object, not an array"),
    (b'"hi"', "must be a JSON object, not a string"),
    (b"null", "must be a JSON object, not null"),
    (b"3", "must be a JSON object, not a number"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_about_the_body(path, raw, says):
    """The message speaks of the body, never of the exception that found it; no worker is asked."""
    async def scenario(client, state, workers):
        r = await client.post(path, content=raw, headers={**ADMIN, "content-type": "application/json"})
        error = assert_error(r, 400, "invalid_request_error")
        assert says in error["message"] and "body" in error["message"], error
        assert not any(word in error["message"] for word in EXCEPTION_WORDS), error
        assert workers.client_calls() == []
    run_router(scenario)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_the_workers_400(path, content_type):
    """As the worker answers (server/serving.py parse_body), before the body is read."""
    async def scenario(client, state, workers):
        headers = {"content-type": content_type} if content_type else {}
        r = await client.post(path, content=b'{"model": "tiny", "prompt": "hi"}', headers=headers)
        error = assert_error(r, 400, "invalid_request_error", param="content-type")
        assert error["message"] == "Content-Type must be application/json", error
        assert workers.client_calls() == []
    run_router(scenario)


@pytest.mark.parametrize("field,value", [
    ("model", 5), ("prompt", {"a": 1}), ("prompt", [[1, "a"]]), ("prompt", [None]), ("stream", "yes"),
    ("n", [1]), ("n", {}), ("max_tokens", "5"), ("user", [1]), ("resume_token_ids", "ab"),
    ("messages", 5), ("messages", [1, "hi"]), ("messages", [{"role": 5, "content": {"a": 1}}]),
    ("messages", [{"role": "user", "content": [1, {"text": 2}]}]), ("messages", {"role": "user"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_fields_of_the_wrong_type_go_to_the_worker_which_judges_them(field, value, stream):
    """The router reads these fields to route; a wrong type routes by what is left and the worker
    answers it (its 400 is relayed), never a router 500."""
    async def scenario(client, state, workers):
        for path in ROUTES:
            body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                    "stream": stream, field: value}
            r = await client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        assert len(workers.client_calls()) == 2
    run_router(scenario)
