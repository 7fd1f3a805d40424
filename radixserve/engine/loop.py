"""The engine process: builds what it drives from a factory, then loops drain messages -> step -> send outputs."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, NoReturn, Protocol

import msgspec
import zmq

from radixserve.engine.messages import (Abort, AddReq, Call, CallResult, EngineInfo, Fatal, FromEngine,
                                        Heartbeat, Ready, Shutdown, Submitted,
                                        ToEngine, WireError)
from radixserve.engine.runner_api import Runner
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest, RadixServeError
from radixserve.outputs import EngineOutput
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
GRAMMAR_POLL_MS = 20
SEND_TIMEOUT_MS = 2000    # a blocked send re-checks the parent instead of hanging forever
HEARTBEAT_S = 1.0
GROUP_CHECK_S = 2.0
CALL_METHODS = ("stats", "flush_cache", "check_invariants", "add_eos_token_ids",
                "fault", "profile")
# The calls EngineParts.calls may add, and the refusal (message, param) when it does not.
OPTIONAL_CALLS = {"fault": ("fault injection is off (--enable-fault-injection)", "kind"),
                  "profile": ("the profiler is off (--torch-profiler-dir)", None)}


class Driven(Protocol):
    """An Engine or a PD worker holding one; optional: `io_sockets() -> list` to wake on, `close()`."""

    runner: Runner

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    **extra: Any) -> None: ...

    def abort(self, request_id: str, reason: str = "abort") -> EngineOutput | None: ...

    def step(self) -> list[EngineOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict: ...

    def flush_cache(self) -> bool: ...

    def check_invariants(self) -> None: ...

    def add_eos_token_ids(self, token_ids: list[int]) -> None: ...


class EngineParts(NamedTuple):
    driven: Driven
    info: EngineInfo
    calls: dict[str, Callable[..., Any]] = {}   # OPTIONAL_CALLS this engine answers


# Picklable by reference into the spawned process, so the loop never imports what it drives.
PartsFactory = Callable[[EngineConfig, frozenset[int]], EngineParts]
RunnerFactory = Callable[[EngineConfig], Runner]


class _Refused(Exception):
    """A ValueError while building the engine: reported as one line, the traceback at debug level."""


class EngineLoop:
    def __init__(self, engine: Driven, inbox: zmq.Socket, outbox: zmq.Socket,
                 calls: dict[str, Callable[..., Any]] | None = None):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.calls = calls or {}
        self.decoder = msgspec.msgpack.Decoder(ToEngine)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.running = True
        self.last_send_s = self.last_group_check_s = time.monotonic()
        # Groups whose grammars compile on a worker thread, so they never stall the other requests.
        self.compiling: list[tuple[list[AddReq], Future]] = []
        self.aborted_while_compiling: set[str] = set()
        self._grammar_pool: ThreadPoolExecutor | None = None

    def send(self, msg: FromEngine) -> None:
        data = self.encoder.encode(msg)
        while True:
            try:
                self.outbox.send(data)
                self.last_send_s = time.monotonic()
                return
            except zmq.Again:
                if not _parent_alive():
                    raise SystemExit(0) from None

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        for sock in getattr(self.engine, "io_sockets", list)():
            poller.register(sock, zmq.POLLIN)
        while self.running:
            self.settle_compiles()
            busy = self.engine.has_unfinished()
            if busy or poller.poll(GRAMMAR_POLL_MS if self.compiling else IDLE_POLL_MS):
                self.drain()
            elif not _parent_alive():
                logger.info("parent process is gone; engine exits")
                return
            else:
                self.check_group()
            if self.running and self.engine.has_unfinished():
                outputs = self.engine.step()
                if outputs:
                    self.send(outputs)
            if self.running and time.monotonic() - self.last_send_s >= HEARTBEAT_S:
                self.send(Heartbeat())

    def check_group(self) -> None:
        """Idle: the runner's optional `check_group()` every GROUP_CHECK_S; a dead rank raises, ending the engine."""
        check = getattr(self.engine.runner, "check_group", None)
        if check is not None and time.monotonic() - self.last_group_check_s >= GROUP_CHECK_S:
            self.last_group_check_s = time.monotonic()
            check()

    def drain(self) -> None:
        while self.running:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(data))

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, list):
            self.submit(msg)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self.engine.abort(rid, msg.reason)
            if self.compiling:
                self.aborted_while_compiling.update(msg.request_ids)
        elif isinstance(msg, Call):
            self.call(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def submit(self, adds: list[AddReq]) -> None:
        if any(self._compiles_first(add.params) for add in adds):
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            validate = self.engine.runner.validate_params
            self.compiling.append((adds, self._grammar_pool.submit(
                lambda: [_quietly(validate, add.params) for add in adds])))
            return
        self.add_group(adds)

    def _compiles_first(self, params: Any) -> bool:
        pending = getattr(self.engine.runner, "grammar_pending", None)
        if pending is None or not pending(params):
            return False
        try:
            params.validate(self.engine.runner.vocab_size)
        except RadixServeError:
            return False
        return True

    def settle_compiles(self) -> None:
        for entry in [e for e in self.compiling if e[1].done()]:
            self.compiling.remove(entry)
            self.add_group(entry[0])
            for add in entry[0]:
                if add.request_id in self.aborted_while_compiling:
                    self.engine.abort(add.request_id)
        if not self.compiling:
            self.aborted_while_compiling.clear()

    def add_group(self, adds: list[AddReq]) -> None:
        group_id = adds[0].request_id
        added: list[str] = []
        try:
            for add in adds:
                extra = {"pd": add.pd} if add.pd is not None else {}
                self.engine.add_request(add.request_id, add.prompt_ids, add.params, **extra)
                added.append(add.request_id)
        except Exception as exc:
            if not isinstance(exc, RadixServeError):
                logger.exception("add_request failed for group %s", group_id)
            for rid in added:
                self.engine.abort(rid)
            self.send(Submitted(group_id, WireError.from_exc(exc)))
            return
        self.send(Submitted(group_id))

    def call(self, msg: Call) -> None:
        if msg.method not in CALL_METHODS:
            self.send(CallResult(msg.call_id, error=f"unknown method {msg.method!r}"))
            return
        try:
            value = (self._optional(msg.method, msg.args) if msg.method in OPTIONAL_CALLS
                     else getattr(self.engine, msg.method)(**msg.args))
        except RadixServeError as exc:
            logger.warning("engine call %s refused: %s", msg.method, exc.message)
            self.send(CallResult(msg.call_id, error=exc.message,
                                 wire_error=WireError.from_exc(exc)))
            return
        except Exception as exc:
            logger.exception("engine call %s failed", msg.method)
            self.send(CallResult(msg.call_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self.send(CallResult(msg.call_id, value=value))

    def _optional(self, method: str, args: dict[str, Any]) -> Any:
        if method not in self.calls:
            message, param = OPTIONAL_CALLS[method]
            raise InvalidRequest(message, param=param)
        return self.calls[method](**args)


def _enc_hook(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:   # noqa: BLE001 -- add_request raises it again
        pass


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def run_engine_process(config: EngineConfig, to_engine_addr: str, from_engine_addr: str,
                       log_level: str, engine_factory: PartsFactory,
                       eos_token_ids: frozenset[int]) -> None:
    """Entry point of the spawned engine process; `eos_token_ids`: the tokenizer's, besides the model's."""
    # Ctrl-C reaches the whole process group; the HTTP process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(to_engine_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(from_engine_addr)
    loop: EngineLoop | None = None
    try:
        try:
            parts = engine_factory(config, eos_token_ids)
        except ValueError as exc:
            logger.debug("engine refused its configuration:\n%s", traceback.format_exc())
            raise _Refused(f"{type(exc).__name__}: {exc}") from None
        loop = EngineLoop(parts.driven, inbox, outbox, parts.calls)
        loop.send(Ready(parts.info))
        loop.run()
        disk = getattr(getattr(parts.driven.runner, "host_kv", None), "disk", None)
        if disk is not None:
            disk.flush()
    except SystemExit:
        raise
    except BaseException as exc:
        refused = isinstance(exc, _Refused)
        message = str(exc) if refused else traceback.format_exc()
        logger.error("engine failed:%s%s", " " if refused else "\n", message)
        try:
            outbox.send(msgspec.msgpack.encode(Fatal(message)), zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.error("could not report the failure to the HTTP process")
        raise SystemExit(1) from None
    finally:
        if loop is not None and hasattr(loop.engine, "close"):
            loop.engine.close()
        inbox.close(0)
        outbox.close()
        ctx.term()
    end_process_now(0)


def end_process_now(code: int) -> NoReturn:
    """Flush logs and stdio, then os._exit(code), skipping interpreter teardown: shutdown must be done."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
