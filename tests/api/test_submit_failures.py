"""A failure at any step of `EngineClient.submit` (registering, encoding, sending) leaves no
open-request slot, no route and no engine request behind (issue 11, finding 1), over the real
engine process and a scripted runner."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from radixserve.compose import EngineFactory
from radixserve.engine.messages import AddReq
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.server.engine_client import EngineClient
from tests.api.fake_runners import fake_runner

CONFIG = EngineConfig(page_size=4, chunked_prefill_size=64, max_running_requests=8)


class Injected(Exception):
    """The failure a test injects."""


class FailingRoutes(dict):
    """The client's route table, failing on its `fail_at`-th insertion (0-based)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at
        self.inserted = 0

    def __setitem__(self, key, value) -> None:
        if self.inserted == self.fail_at:
            raise Injected(f"route insert {self.fail_at}")
        self.inserted += 1
        super().__setitem__(key, value)


class FailingEncoder:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def encode(self, msg) -> bytes:
        raise self.exc


class FailingSocket:
    """The PUSH socket, whose `send` raises `exc`; everything else goes to the real socket."""

    def __init__(self, real: zmq.Socket, exc: BaseException):
        self.real = real
        self.exc = exc

    def send(self, *args, **kwargs):
        raise self.exc

    def __getattr__(self, name):
        return getattr(self.real, name)


def group(tag: str, **params) -> list[AddReq]:
    p = SamplingParams(max_tokens=4, **params)
    return [AddReq(f"{tag}-0", [1, 2, 3], p), AddReq(f"{tag}-1", [4, 5], p)]


def route_failure(fail_at: int):
    def inject(client: EngineClient):
        client._routes = FailingRoutes(fail_at)
    return inject


def encode_failure(exc: BaseException):
    def inject(client: EngineClient):
        client._encoder = FailingEncoder(exc)
    return inject


def send_failure(exc: BaseException):
    def inject(client: EngineClient):
        client.push = FailingSocket(client.push, exc)
    return inject


STEPS = {
    "first route": (route_failure(0), Injected),
    "second route": (route_failure(1), Injected),
    "encode overflow": (encode_failure(OverflowError("int too big to convert")), InvalidRequest),
    "encode bug": (encode_failure(Injected("encoder")), Injected),
    "send would block": (send_failure(zmq.Again()), zmq.Again),
    "send bug": (send_failure(Injected("socket")), Injected),
    "send cancelled": (send_failure(asyncio.CancelledError()), asyncio.CancelledError),
}


@pytest.fixture(scope="module")
def engine_client():
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(EngineClient.launch(CONFIG, EngineFactory(fake_runner), log_level="warning"))
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


async def assert_nothing_held(client: EngineClient) -> None:
    """No open request, no route, nothing in the engine, page invariant intact."""
    assert client.num_open_requests == 0
    assert not client._routes
    stats = await client.call("stats")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    await client.call("check_invariants")


async def serve_one(client: EngineClient, tag: str) -> None:
    stream = client.submit(group(tag))
    try:
        await asyncio.wait_for(stream.accepted(), 10)
        while stream.unfinished:
            await asyncio.wait_for(stream.get(), 10)
    finally:
        stream.close()


@pytest.mark.parametrize("step", sorted(STEPS))
def test_failure_at_each_submit_step_holds_no_slot(engine_client, step):
    loop, client = engine_client
    inject, raised = STEPS[step]
    saved = (client._routes, client._encoder, client.push)

    async def scenario() -> None:
        inject(client)
        try:
            with pytest.raises(raised):
                client.submit(group(f"fail-{step.replace(' ', '-')}"))
        finally:
            client._routes, client._encoder, client.push = saved
        await assert_nothing_held(client)
        await serve_one(client, f"after-{step.replace(' ', '-')}")
        await assert_nothing_held(client)

    loop.run_until_complete(scenario())


def test_real_overflow_is_a_400_and_no_slot(engine_client):
    """The issue's request without the schema bounds: a seed of 2**64 reaches msgpack."""
    loop, client = engine_client

    async def scenario() -> None:
        for i in range(20):
            with pytest.raises(InvalidRequest, match="cannot be represented"):
                client.submit(group(f"overflow-{i}", seed=2**64))
        await assert_nothing_held(client)
        await serve_one(client, "after-overflow")

    loop.run_until_complete(scenario())
