"""The ZMQ transport between the HTTP process and the engine process, over the real Engine and a
scripted runner (no model, no HTTP)."""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from radixserve.compose import EngineFactory
from radixserve.engine.messages import AddReq
from radixserve.engine_config import EngineConfig
from radixserve.errors import ContextLengthExceeded, EngineDead, InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.server.engine_client import EngineClient
from tests.api.fake_runners import (FAKE_CONTEXT, WEDGE_TOKEN, crashing_runner, failing_runner,
                                    fake_runner, refusing_runner, wedging_runner)
from tests.unit.fake_runner import reference_next_token

CONFIG = EngineConfig(page_size=4, chunked_prefill_size=64, max_running_requests=8)
pytestmark = pytest.mark.asyncio(loop_scope="module")   # one event loop: `client` is shared by the module's tests


async def collect(stream) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while stream.unfinished:
        out = await asyncio.wait_for(stream.get(), 10)
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def expected(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(reference_next_token(ids, 1000))
    return ids[len(prompt):]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    """One engine process for the tests that leave it idle (distinct request ids, every stream closed)."""
    c = await EngineClient.launch(CONFIG, EngineFactory(fake_runner), log_level="warning")
    yield c
    await c.close()


async def test_ready_info_and_generation(client):
    assert client.info.max_context_len == FAKE_CONTEXT
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompt = [1, 2, 3, 4, 5, 6]
    stream = client.submit([AddReq("a-0", prompt, params), AddReq("a-1", prompt + [7], params)])
    await stream.accepted()
    tokens = await collect(stream)
    stream.close()
    assert tokens == {"a-0": expected(prompt, 5), "a-1": expected(prompt + [7], 5)}
    assert client.num_open_requests == 0


async def test_start_up_eos_ids_end_requests():
    """The eos ids given at launch (the HTTP side's tokenizer ids) stop requests in the engine
    process, which has no tokenizer: the fake model's third token is declared an eos."""
    prompt = [1, 2, 3, 4, 5, 6]
    eos = expected(prompt, 3)[2]
    client = await EngineClient.launch(CONFIG, EngineFactory(fake_runner), frozenset({eos}), "warning")
    try:
        stream = client.submit([AddReq("e", prompt, SamplingParams(max_tokens=10, temperature=0.0))])
        await stream.accepted()
        tokens = await collect(stream)
        stream.close()
    finally:
        await client.close()
    assert tokens == {"e": expected(prompt, 3)}


async def test_concurrent_groups_do_not_mix(client):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = {f"g{i}": [i + 1] * (i + 3) for i in range(6)}
    streams = [client.submit([AddReq(rid, p, params)]) for rid, p in prompts.items()]
    for s in streams:
        await s.accepted()
    results = await asyncio.gather(*(collect(s) for s in streams))
    for s, got in zip(streams, results):
        s.close()
        ((rid, ids),) = got.items()
        assert ids == expected(prompts[rid], 8)


async def test_rejection_is_atomic_and_typed(client):
    ok = SamplingParams(max_tokens=4)
    stream = client.submit([AddReq("r-0", [1, 2], ok),
                            AddReq("r-1", [1] * 10, SamplingParams(max_tokens=FAKE_CONTEXT))])
    with pytest.raises(ContextLengthExceeded) as err:
        await stream.accepted()
    assert str(FAKE_CONTEXT) in err.value.message
    stream.close()
    stream = client.submit([AddReq("r-0", [], ok)])  # r-0 was rolled back, so its id is free
    with pytest.raises(InvalidRequest):
        await stream.accepted()
    stream.close()
    stats = await client.call("stats")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


async def test_abort_on_close_frees_the_engine(client):
    stream = client.submit([AddReq("long", [5, 6, 7], SamplingParams(max_tokens=400))])
    await stream.accepted()
    await stream.get()
    stream.close()
    for _ in range(100):
        stats = await client.call("stats")
        if stats["num_running"] == 0:
            break
        await asyncio.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    await client.call("check_invariants")
    assert await client.call("flush_cache") is True


async def test_unknown_call_is_an_error(client):
    with pytest.raises(RuntimeError, match="unknown method"):
        await client.call("step")


async def test_engine_crash_fails_waiting_requests():
    client = await EngineClient.launch(CONFIG, EngineFactory(crashing_runner), log_level="critical")
    try:
        stream = client.submit([AddReq("x", [1, 2, 3], SamplingParams(max_tokens=50))])
        await stream.accepted()
        with pytest.raises(EngineDead):
            await collect(stream)
        assert not client.is_alive
        with pytest.raises(EngineDead):
            client.submit([AddReq("y", [1], SamplingParams())])
    finally:
        await client.close()


async def test_engine_load_failure_raises():
    with pytest.raises(RuntimeError, match="model.gguf"):
        await EngineClient.launch(CONFIG, EngineFactory(failing_runner), log_level="critical")


async def test_a_refused_setting_is_reported_in_one_line():
    """A ValueError while the engine is built is a setting it refuses: the start-up error is
    its message alone, not a traceback (that stays at debug level)."""
    with pytest.raises(RuntimeError) as err:
        await EngineClient.launch(CONFIG, EngineFactory(refusing_runner), log_level="critical")
    assert str(err.value) == ("engine failed to start:\nValueError: RADIXSERVE_SINGLE_ROW_PATH='bogus': "
                              "expected one of ('split', 'linear', 'packed')")


async def test_watchdog_kills_a_wedged_engine():
    """A step that never ends: heartbeats stop, the watchdog declares the engine dead after its
    timeout, fails the waiting request and kills the process. An idle engine is never declared
    dead, however long it stays idle (heartbeats keep coming)."""
    client = await EngineClient.launch(CONFIG, EngineFactory(wedging_runner), log_level="critical",
                                       watchdog_timeout_s=2.0)
    try:
        ok = client.submit([AddReq("ok", [1, 2, 3], SamplingParams(max_tokens=3))])
        await ok.accepted()
        await collect(ok)
        ok.close()
        await asyncio.sleep(3.0)  # idle past the timeout: still alive
        assert client.is_alive
        stream = client.submit([AddReq("x", [WEDGE_TOKEN, 2, 3], SamplingParams(max_tokens=5))])
        await stream.accepted()
        with pytest.raises(EngineDead, match="step never ended"):
            await asyncio.wait_for(stream.get(), 30)
        await asyncio.to_thread(client.proc.join, 10)
        assert not client.proc.is_alive()
    finally:
        await client.close()

