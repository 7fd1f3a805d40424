"""The router's in-flight count of a worker (its load reading, /admin/workers, the in_flight gauge) is back at 0
after a stream ends in every way: completed, client gone, ejected, drain cut-off, worker error, retried, continued;
driven as ASGI against fake workers (httpx MockTransport), PD mode included."""
from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest

from radixserve.router.app import build_app
from radixserve.router.config import RouterConfig
from radixserve.router.lease import Lease
from radixserve.router.metrics import PREFIX
from radixserve.router.proxy import Forwarder
from radixserve.router.state import build_pd_state, build_state
from tests.api.test_router_eject import NoAnswer, Stalls
from tests.api.test_router_migration import text_chunk
from tests.api.test_router_stream_path import AsgiClient

WAIT_S = 60.0   # generous bound on every wait for a state change (never pass/fail timing)
W0, W1 = "http://w0:8000", "http://w1:8000"
FIRST, SECOND = text_chunk("a", "He", [1]), text_chunk("b", "llo", [2])
DONE = b"data: [DONE]\n\n"
ENGINE_DEAD = b'data: {"error": {"message": "x", "type": "engine_dead", "param": null, "code": 503}}\n\n'


def sse(stream: httpx.AsyncByteStream) -> httpx.Response:
    return httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})


class Broken(httpx.AsyncByteStream):
    """Sends `chunks`, then the connection drops."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset")


class CutOffAtFirst(httpx.AsyncByteStream):
    """Starts the router's drain cut-off just as its first content event arrives, then holds."""

    def __init__(self):
        self.state, self.closed = None, asyncio.Event()

    async def __aiter__(self):
        self.state.drain.cut_off()
        yield FIRST
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


def make_state(answers: dict, **config):
    """A router over W0 and W1 (round robin: W0 first) whose POSTs answers[url](request) answers;
    a worker without an answer refuses connections."""
    cfg = RouterConfig(policy="round_robin", retry_initial_backoff_ms=1, **config)
    state = build_state(cfg, [W0, W1])
    for worker in state.registry.list():
        worker.healthy = True

    async def transport(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/get_server_info"):
            return httpx.Response(200, json={})
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url not in answers:
            raise httpx.ConnectError("connection refused", request=request)
        answer = answers[url](request)
        return await answer if inspect.isawaitable(answer) else answer

    state.http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    state.forwarder = Forwarder(cfg, state.registry, state.policy, state.metrics, state.http)
    return state


def eject(state, url: str) -> None:
    state.registry.get(url).eject_streams()


def stalled(chunks):
    stream = Stalls(chunks)
    return stream, lambda request: sse(stream)


def case_completed():
    return {W0: lambda r: sse(httpx.ByteStream(FIRST + DONE))}, None


def case_client_left_mid_stream():
    s0, a0 = stalled([FIRST])
    return {W0: a0}, (s0.stalled, lambda state, client: client.leave())


def case_client_left_before_content():
    s0, a0 = stalled([])
    return {W0: a0}, (s0.stalled, lambda state, client: client.leave())


def case_client_left_before_headers():
    hung = NoAnswer()
    return {W0: lambda r: hung()}, (hung.asked, lambda state, client: client.leave())


def case_ejected_and_continued():
    s0, a0 = stalled([FIRST])
    return {W0: a0, W1: lambda r: sse(httpx.ByteStream(SECOND + DONE))}, (s0.stalled, lambda s, c: eject(s, W0))


def case_ejected_with_no_worker_to_continue():
    s0, a0 = stalled([FIRST])
    return {W0: a0}, (s0.stalled, lambda state, client: eject(state, W0))


def case_ejected_before_content_and_retried():
    s0, a0 = stalled([])
    return {W0: a0, W1: lambda r: sse(httpx.ByteStream(FIRST + DONE))}, (s0.stalled, lambda s, c: eject(s, W0))


def case_continuation_left_by_the_client():
    s0, a0 = stalled([FIRST])
    s1, a1 = stalled([SECOND])

    async def act(state, client):
        eject(state, W0)
        await s1.stalled.wait()
        client.leave()
    return {W0: a0, W1: a1}, (s0.stalled, act)


def case_drain_cut_off_mid_stream():
    s0, a0 = stalled([FIRST])
    return {W0: a0}, (s0.stalled, lambda state, client: state.drain.cut_off())


def case_drain_cut_off_before_content():
    s0, a0 = stalled([])
    return {W0: a0}, (s0.stalled, lambda state, client: state.drain.cut_off())


def case_transport_error_mid_stream_continued():
    return {W0: lambda r: sse(Broken([FIRST])), W1: lambda r: sse(httpx.ByteStream(SECOND + DONE))}, None


def case_error_event_mid_stream_with_no_worker_to_continue():
    return {W0: lambda r: sse(httpx.ByteStream(FIRST + ENGINE_DEAD + DONE))}, None


def case_retried_after_a_503():
    busy = {"error": {"message": "busy", "type": "server_overloaded", "param": None, "code": 503}}
    return {W0: lambda r: httpx.Response(503, json=busy),
            W1: lambda r: sse(httpx.ByteStream(FIRST + DONE))}, None


CASES = [case_completed, case_client_left_mid_stream, case_client_left_before_content,
         case_client_left_before_headers, case_ejected_and_continued, case_ejected_with_no_worker_to_continue,
         case_ejected_before_content_and_retried, case_continuation_left_by_the_client,
         case_drain_cut_off_mid_stream, case_drain_cut_off_before_content,
         case_transport_error_mid_stream_continued, case_error_event_mid_stream_with_no_worker_to_continue,
         case_retried_after_a_503]


def assert_idle(state) -> None:
    for worker in state.registry.list():
        assert worker.in_flight == 0 and worker.streams == set(), worker
    assert state.drain.num_in_flight == 0
    state.refresh_gauges()
    gauges = [s.value for f in state.metrics.registry.collect() for s in f.samples
              if s.name == PREFIX + "in_flight"]
    assert gauges == [0.0, 0.0], gauges


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.removeprefix("case_") for c in CASES])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_way_a_stream_ends_leaves_the_workers_idle(case, path):
    async def main():
        answers, action = case()
        state = make_state(answers)
        client = AsgiClient(build_app(state), {"prompt": "hi", "messages": [], "stream": True}, path)
        task = client.run()
        if action is not None:
            happened, act = action
            await asyncio.wait_for(happened.wait(), WAIT_S)
            acted = act(state, client)
            if inspect.isawaitable(acted):
                await asyncio.wait_for(acted, WAIT_S)
        await asyncio.wait_for(task, WAIT_S)
        assert_idle(state)
        await state.http.aclose()
    asyncio.run(main())


def test_a_drain_cut_off_as_the_first_content_arrives_closes_the_stream_it_opened():
    """The forward finished with an open worker stream as the cut-off cancelled the handler:
    that stream has no taker, and is closed (it was left to the garbage collector)."""
    async def main():
        stream = CutOffAtFirst()
        state = make_state({W0: lambda r: sse(stream)})
        stream.state = state
        client = AsgiClient(build_app(state), {"prompt": "hi", "stream": True})
        await asyncio.wait_for(client.run(), WAIT_S)
        assert b'"code":"draining"' in client.body(), client.body()
        assert stream.closed.is_set()
        assert_idle(state)
        await state.http.aclose()
    asyncio.run(main())


def test_a_pd_prefill_leg_releases_its_own_worker_not_one_readded_under_its_url():
    """The prefill leg's count is the Lease's, on the worker object it was dispatched to."""
    async def main():
        state = build_pd_state(RouterConfig(policy="round_robin"), [W0], [W1])
        for side in (state, state.pd.decode):
            for worker in side.registry.list():
                worker.healthy = True
        prefill_gate, decode = asyncio.Event(), Stalls([FIRST])

        async def transport(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/get_server_info":
                return httpx.Response(200, json={"disaggregation_mode": "prefill",
                                                 "bootstrap_address": "http://127.0.0.1:9"})
            if request.url.host == "w0":
                await prefill_gate.wait()
                return httpx.Response(200, json={"choices": []})
            return sse(decode)

        state.http = state.pd.http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
        client = AsgiClient(build_app(state), {"prompt": "hi", "stream": True})
        task = client.run()
        await asyncio.wait_for(decode.stalled.wait(), WAIT_S)
        old = state.registry.get(W0)
        assert old.in_flight == 1
        state.remove_worker(W0)
        new = state.add_worker(W0, healthy=True)
        held = Lease(state.registry, new)       # a request of its own
        prefill_gate.set()
        client.leave()
        await asyncio.wait_for(task, WAIT_S)
        await asyncio.sleep(0)                  # the prefill leg's done callback
        assert (old.in_flight, new.in_flight) == (0, 1)
        held.release()
        assert new.in_flight == 0 and state.pd.decode.registry.get(W1).in_flight == 0
        await state.http.aclose()
    asyncio.run(main())
