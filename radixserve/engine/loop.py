"""The engine process: builds the Engine over a runner from a factory, then loops
drain-messages -> step -> push outputs (the wire messages are in engine/messages.py)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NoReturn

import msgspec
import zmq

from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.messages import (Abort, Call, CallResult, EngineInfo, Fatal, FromEngine,
                                        Heartbeat, Outputs, Ready, Shutdown, Submit, Submitted,
                                        ToEngine, WireError)
from radixserve.engine.runner_api import Runner
from radixserve.errors import RadixServeError

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500        # how often an idle engine checks that its parent is alive
GRAMMAR_POLL_MS = 20      # how often an engine waiting only for a grammar compile looks at it
SEND_TIMEOUT_MS = 2000    # a blocked send re-checks the parent instead of hanging forever
HEARTBEAT_S = 1.0         # the loop says it is alive at least this often (between steps)
CALL_METHODS = ("flush_cache", "stats", "check_invariants", "add_eos_token_ids",  # Engine methods
                "arm_forced_tokens", "disarm_forced_tokens", "arm_kv_corrupt",
                "disarm_kv_corrupt", "arm_pd_fault", "disarm_pd_fault",
                "arm_hicache_h2d", "disarm_hicache_h2d",
                "arm_hicache_d2h", "disarm_hicache_d2h", "arm_hicache_host_alloc",
                "disarm_hicache_host_alloc", "arm_hicache_l3", "disarm_hicache_l3")
LOOP_METHODS = ("set_step_latency",)                          # EngineLoop methods


# ---- engine construction --------------------------------------------------------------------
# A runner factory is `factory(config) -> Runner`, a module-level function (it is pickled by
# reference into the spawned process). The real one, which loads the model, is
# radixserve.cli.build_runner: neither engine/ nor server/ imports the runner (docs/architecture.md).
RunnerFactory = Callable[[EngineConfig], Runner]


class _Refused(Exception):
    """The engine refused its configuration at start-up (a ValueError while building it):
    reported as one line, the traceback only at debug level."""


def build_engine(config: EngineConfig, runner_factory: RunnerFactory,
                 eos_token_ids: frozenset[int]) -> tuple[Engine, EngineInfo]:
    """The Engine over `runner_factory(config)`, stopping on the model's eos ids plus
    `eos_token_ids` (the tokenizer's, end of turn included, resolved by the HTTP process), and
    the EngineInfo the HTTP process learns at start-up."""
    engine_cls = Engine
    if config.disaggregation_mode != "null":   # a prefill or decode worker (radixserve/disagg)
        from radixserve.disagg.engine import PDEngine
        engine_cls = PDEngine
    engine = engine_cls(config, runner_factory(config), eos_token_ids)
    info = EngineInfo(max_context_len=engine.max_request_tokens, page_size=engine.page_size,
                      disaggregation_mode=config.disaggregation_mode,
                      bootstrap_address=getattr(engine, "bootstrap_address", None))
    return engine, info


# ---- the loop -------------------------------------------------------------------------------
class EngineLoop:
    """Owns the two sockets and the Engine; `run()` returns when told to shut down or when the
    parent process is gone."""

    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.decoder = msgspec.msgpack.Decoder(ToEngine)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.running = True
        self.last_send_s = time.monotonic()
        self.step_latency: StepLatency | None = None
        # Submits whose new grammars compile on a worker thread meanwhile (seconds for some
        # schemas; xgrammar releases the GIL), so they never stall the other requests' steps.
        self.compiling: list[tuple[Submit, Future]] = []
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
        for sock in getattr(self.engine, "io_sockets", list)():   # PD: wake on the peer too
            poller.register(sock, zmq.POLLIN)
        while self.running:
            self.settle_compiles()
            busy = self.engine.has_unfinished()
            if busy or poller.poll(GRAMMAR_POLL_MS if self.compiling else IDLE_POLL_MS):
                self.drain()
            elif not _parent_alive():
                logger.info("parent process is gone; engine exits")
                return
            if self.running and self.engine.has_unfinished():
                if self.step_latency is not None:
                    self.step_latency = self.step_latency.sleep()
                outputs = self.engine.step()
                if outputs:
                    self.send(Outputs(outputs))
            if self.running and time.monotonic() - self.last_send_s >= HEARTBEAT_S:
                self.send(Heartbeat())

    def drain(self) -> None:
        """Handle every message already queued, without blocking."""
        while self.running:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(data))

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, Submit):
            self.submit(msg)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self.engine.abort(rid, msg.reason)
            if self.compiling:   # aborted before they were added: added, then aborted at once
                self.aborted_while_compiling.update(msg.request_ids)
        elif isinstance(msg, Call):
            self.call(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def submit(self, msg: Submit) -> None:
        """Add all requests of a group or none of them; a group with a grammar not yet compiled
        waits (answered later by settle_compiles) while its grammars compile on a worker thread."""
        if any(self._compiles_first(add.params) for add in msg.adds):
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            validate = self.engine.runner.validate_params
            self.compiling.append((msg, self._grammar_pool.submit(
                lambda: [_quietly(validate, add.params) for add in msg.adds])))
            return
        self.add_group(msg)

    def _compiles_first(self, params: Any) -> bool:
        """Whether `params` is valid (else add_group answers its error at once) and carries a
        grammar the runner has yet to compile."""
        pending = getattr(self.engine.runner, "grammar_pending", None)
        if pending is None or not pending(params):   # most requests: no new grammar, no work here
            return False
        try:
            params.validate(self.engine.runner.vocab_size)
        except RadixServeError:
            return False
        return True

    def settle_compiles(self) -> None:
        """Add the groups whose grammars are compiled (the compile's error, if any, is raised
        again, from the cache, by add_request)."""
        for entry in [e for e in self.compiling if e[1].done()]:
            self.compiling.remove(entry)
            self.add_group(entry[0])
            for add in entry[0].adds:
                if add.request_id in self.aborted_while_compiling:
                    self.engine.abort(add.request_id)
        if not self.compiling:
            self.aborted_while_compiling.clear()

    def add_group(self, msg: Submit) -> None:
        """Add all requests of a group or none of them, and answer Submitted."""
        added: list[str] = []
        try:
            for add in msg.adds:
                extra = {"pd": add.pd} if add.pd is not None else {}
                self.engine.add_request(add.request_id, add.prompt_ids, add.params, **extra)
                added.append(add.request_id)
        except Exception as exc:  # a client error must not kill the engine; bugs are logged
            if not isinstance(exc, RadixServeError):
                logger.exception("add_request failed for group %s", msg.group_id)
            for rid in added:
                self.engine.abort(rid)
            self.send(Submitted(msg.group_id, WireError.from_exc(exc)))
            return
        self.send(Submitted(msg.group_id))

    def call(self, msg: Call) -> None:
        if msg.method not in CALL_METHODS + LOOP_METHODS:
            self.send(CallResult(msg.call_id, error=f"unknown method {msg.method!r}"))
            return
        target = self if msg.method in LOOP_METHODS else self.engine
        try:
            value = getattr(target, msg.method)(**msg.args)
        except RadixServeError as exc:   # the caller's arguments were refused (a 400 upstream)
            logger.warning("engine call %s refused: %s", msg.method, exc.message)
            self.send(CallResult(msg.call_id, error=exc.message,
                                 wire_error=WireError.from_exc(exc)))
            return
        except Exception as exc:
            logger.exception("engine call %s failed", msg.method)
            self.send(CallResult(msg.call_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self.send(CallResult(msg.call_id, value=value))


    def set_step_latency(self, latency_ms: float, jitter_ms: float = 0.0,
                         duration_s: float | None = None) -> None:
        """Fault injection: sleep latency_ms (uniform +- jitter_ms, floored at 0) before each
        step for duration_s (None: until set to 0 again)."""
        ends_s = None if duration_s is None else time.monotonic() + duration_s
        self.step_latency = (StepLatency(latency_ms / 1000, jitter_ms / 1000, ends_s)
                             if latency_ms > 0 or jitter_ms > 0 else None)


class StepLatency(msgspec.Struct, frozen=True):
    """An injected per-step delay (seconds) until `ends_s` (time.monotonic(); None: no end)."""

    latency_s: float
    jitter_s: float
    ends_s: float | None

    def sleep(self) -> StepLatency | None:
        """Sleep once; returns self, or None once expired."""
        if self.ends_s is not None and time.monotonic() >= self.ends_s:
            return None
        time.sleep(max(self.latency_s + random.uniform(-self.jitter_s, self.jitter_s), 0.0))
        return self


def _enc_hook(obj: Any) -> Any:
    """Encode what msgpack lacks (numpy scalars in stats, sets, ...) as plain values."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args), errors dropped: a grammar compiled ahead raises again when the group is added."""
    try:
        fn(*args)
    except Exception:   # noqa: BLE001 -- reported by add_request, from the cache
        pass


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def run_engine_process(config: EngineConfig, to_engine_addr: str, from_engine_addr: str,
                       log_level: str, runner_factory: RunnerFactory,
                       eos_token_ids: frozenset[int]) -> None:
    """Entry point of the spawned engine process (see build_engine for the last two arguments)."""
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
            engine, info = build_engine(config, runner_factory, eos_token_ids)
        except ValueError as exc:   # a setting the engine refuses: its message says it all
            logger.debug("engine refused its configuration:\n%s", traceback.format_exc())
            raise _Refused(f"{type(exc).__name__}: {exc}") from None
        loop = EngineLoop(engine, inbox, outbox)
        loop.send(Ready(info))
        loop.run()
        disk = getattr(getattr(engine.runner, "host_kv", None), "disk", None)
        if disk is not None:   # pages still being saved reach the disk tier before exit
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
            loop.engine.close()   # PD: the transport's sockets
        inbox.close(0)
        outbox.close()
        ctx.term()
    end_process_now(0)


def end_process_now(code: int) -> NoReturn:
    """Flush logs and stdio, then os._exit(code). For a process whose shutdown is done (its
    sockets closed, its disk writes flushed): interpreter finalization would spend about a
    second tearing down torch's and transformers' modules with nothing left to release."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
