"""The engine loop compiles a request's new grammar on a worker thread: other requests keep stepping meanwhile, the group is answered (accepted, or its grammar's error) once the compile ends, and an abort that comes first still ends it. Driven by an Event, over in-process ZMQ sockets (no timing)."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from radixserve.engine.engine import Engine
from radixserve.engine.loop import EngineLoop
from radixserve.engine.messages import (Abort, AddReq, FromEngine, Shutdown, Submitted,
                                        ToEngine)
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeRunner

WAIT_S = 30.0   # a hang guard, never a timing assertion


class SlowGrammarRunner(FakeRunner):
    """A grammar compiles only once `release` is set; the schema "bad" fails to compile."""

    def __init__(self):
        super().__init__(64, 4, 1000)
        self.release = threading.Event()
        self.compiled: set[str] = set()

    def grammar_pending(self, params):
        return params.json_schema is not None and params.json_schema not in self.compiled

    def validate_params(self, params):
        if params.json_schema is None:
            return
        if params.json_schema not in self.compiled:
            assert self.release.wait(WAIT_S), "the compile was never released"
            self.compiled.add(params.json_schema)
        if params.json_schema == "bad":
            raise InvalidRequest("response_format: the JSON schema cannot be used", param="response_format")


@pytest.fixture
def loop():
    ctx = zmq.Context()
    sockets = {name: ctx.socket(kind) for name, kind in
               (("to", zmq.PUSH), ("inbox", zmq.PULL), ("outbox", zmq.PUSH), ("from", zmq.PULL))}
    sockets["inbox"].bind("inproc://engine-in")
    sockets["to"].connect("inproc://engine-in")
    sockets["from"].bind("inproc://engine-out")
    sockets["outbox"].connect("inproc://engine-out")
    runner = SlowGrammarRunner()
    engine_loop = EngineLoop(Engine(EngineConfig(page_size=4), runner), sockets["inbox"], sockets["outbox"])
    thread = threading.Thread(target=engine_loop.run, daemon=True)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromEngine)
    seen: dict = {"submitted": {}, "finished": set()}

    def send(msg: ToEngine) -> None:
        sockets["to"].send(encoder.encode(msg))

    def until(done, what: str) -> None:
        poller = zmq.Poller()
        poller.register(sockets["from"], zmq.POLLIN)
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"hung waiting for {what}"
            if not poller.poll(100):
                continue
            msg = decoder.decode(sockets["from"].recv())
            if isinstance(msg, Submitted):
                seen["submitted"][msg.group_id] = msg.error
            elif isinstance(msg, list):
                seen["finished"].update(o.request_id for o in msg if o.finished)

    seen["engine"] = engine_loop.engine
    yield runner, send, until, seen
    runner.release.set()
    send(Shutdown())
    thread.join(WAIT_S)
    for sock in sockets.values():
        sock.close(0)
    ctx.term()


def add(rid: str, schema: str | None = None) -> list[AddReq]:
    return [AddReq(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, json_schema=schema))]


def test_a_compiling_grammar_does_not_hold_up_other_requests(loop):
    runner, send, until, seen = loop
    send(add("slow", "{}"))
    send(add("plain"))
    until(lambda: "plain" in seen["finished"], "the plain request to finish")
    assert "slow" not in seen["submitted"], "the grammar's group was answered before it compiled"
    runner.release.set()
    until(lambda: "slow" in seen["finished"], "the grammar request to finish")
    assert seen["submitted"] == {"slow": None, "plain": None}


def test_a_grammar_that_fails_to_compile_is_the_groups_error(loop):
    runner, send, until, seen = loop
    send(add("r1", "bad"))
    runner.release.set()
    until(lambda: "r1" in seen["submitted"], "the group's answer")
    error = seen["submitted"]["r1"]
    assert error is not None and error.param == "response_format"


def test_an_abort_while_compiling_ends_the_request(loop):
    runner, send, until, seen = loop
    send(add("r1", "{}"))
    send(Abort(["r1"]))
    send(add("plain"))   # the loop has handled the abort once this one is done
    until(lambda: "plain" in seen["finished"], "the plain request to finish")
    runner.release.set()
    until(lambda: "r1" in seen["submitted"], "the group's answer")
    assert seen["submitted"]["r1"] is None     # accepted, then aborted at once
    until(lambda: not seen["engine"].has_unfinished(), "the engine to be idle")
    assert "r1" not in seen["engine"].requests and "r1" not in seen["finished"]


def test_params_that_fail_validation_are_refused_before_any_compile(loop):
    runner, send, until, seen = loop
    too_long = "x" * (64 << 10 | 1)   # over the grammar limit: refused without compiling it
    send(add("r1", too_long))
    until(lambda: "r1" in seen["submitted"], "the group's answer")
    assert seen["submitted"]["r1"].param == "response_format" and too_long not in runner.compiled
