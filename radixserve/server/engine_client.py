"""The HTTP process's side of the engine: spawns the engine process, sends it work over ZMQ, routes outputs to per-request queues."""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.engine.loop import PartsFactory, run_engine_process
from radixserve.engine.messages import (AddReq, Abort, Call, CallResult, EngineInfo, Fatal,
                                        FromEngine, Ready, Shutdown, Submitted,
                                        WireError)
from radixserve.engine_config import EngineConfig
from radixserve.errors import (ContextLengthExceeded, EngineDead, InvalidRequest, KVTransferFailed,
                               ModelNotFound, Overloaded, RadixServeError)
from radixserve.outputs import EngineOutput

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5
DEFAULT_WATCHDOG_TIMEOUT_S = 300.0   # SGLang's --watchdog-timeout default
SHUTDOWN_TIMEOUT_S = 10.0


class _Dead:
    def __init__(self, reason: str):
        self.reason = reason


def error_from_wire(err: WireError) -> RadixServeError:
    """Rebuild the exception the engine raised, so the HTTP layer maps it like its own."""
    by_type: dict[str, type[RadixServeError]] = {
        "not_found_error": ModelNotFound, "server_overloaded": Overloaded, "engine_dead": EngineDead,
        "kv_transfer_failed": KVTransferFailed}
    if err.code == ContextLengthExceeded.code:
        cls: type[RadixServeError] = ContextLengthExceeded
    elif err.status == 400:
        cls = InvalidRequest
    else:
        cls = by_type.get(err.type, RadixServeError)
    return cls(err.message, param=err.param)


class RequestStream:
    """One HTTP request's engine requests: `await accepted()` (raises the engine's rejection),
    then `await get()` per EngineOutput; `close()` (in a `finally`) aborts what is unfinished."""

    def __init__(self, client: EngineClient, group_id: str, request_ids: list[str]):
        self.client = client
        self.group_id = group_id
        self.unfinished = set(request_ids)
        self.queue: asyncio.Queue[EngineOutput | Submitted | _Dead] = asyncio.Queue()

    async def accepted(self) -> None:
        item = await self.queue.get()
        if isinstance(item, _Dead):
            raise EngineDead(item.reason)
        assert isinstance(item, Submitted), f"first event of a group must be Submitted, got {item!r}"
        if item.error is not None:
            self.unfinished.clear()
            raise error_from_wire(item.error)

    async def get(self) -> EngineOutput:
        """The next output of an unfinished request; raises EngineDead, or KVTransferFailed on a failed PD handoff."""
        while True:
            item = await self.queue.get()
            if isinstance(item, _Dead):
                raise EngineDead(item.reason)
            assert isinstance(item, EngineOutput), f"unexpected event {item!r}"
            if item.request_id not in self.unfinished:
                continue
            if item.finished:
                self.unfinished.discard(item.request_id)
            if item.error_code == KVTransferFailed.code:
                raise KVTransferFailed(f"prefill/decode handoff failed: {item.error}")
            return item

    def abort(self, request_id: str) -> None:
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self.client.unroute([request_id])
            self.client.abort([request_id], reason="stop")

    def abort_all(self) -> None:
        """Abort every unfinished request and queue its final "abort" output (the engine sends none)."""
        leftover = sorted(self.unfinished)
        self.client.unroute(leftover)
        self.client.abort(leftover)
        for rid in leftover:
            self.queue.put_nowait(EngineOutput(rid, [], finished=True, finish_reason="abort",
                                               error="aborted by /abort_request"))

    def close(self) -> None:
        leftover = sorted(self.unfinished)
        self.unfinished.clear()
        self.client.release(self, leftover)


class EngineClient:
    """Owns the engine process and the two sockets; create with `await EngineClient.launch(...)`."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, tmpdir: str,
                 push: zmq.Socket, pull: zmq.asyncio.Socket, sync_ctx: zmq.Context,
                 async_ctx: zmq.asyncio.Context,
                 watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S):
        self.proc = proc
        self.watchdog_timeout_s = watchdog_timeout_s
        self.last_heard_s = time.monotonic()
        self.dead = asyncio.Event()
        self.tmpdir = tmpdir
        self.push = push
        self.pull = pull
        self._sync_ctx = sync_ctx
        self._async_ctx = async_ctx
        self.info: EngineInfo | None = None
        self.dead_reason: str | None = None
        self._streams: dict[str, RequestStream] = {}      # group id -> stream
        self._routes: dict[str, RequestStream] = {}       # engine request id -> stream
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    @classmethod
    async def launch(cls, config: EngineConfig, engine_factory: PartsFactory,
                     eos_token_ids: frozenset[int] = frozenset(), log_level: str = "info",
                     watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S) -> EngineClient:
        """Spawn the engine process and wait for Ready (RuntimeError if it fails); once silent for
        `watchdog_timeout_s` with work pending, it is declared dead and killed."""
        tmpdir = tempfile.mkdtemp(prefix="radixserve-")
        to_engine, from_engine = f"ipc://{tmpdir}/to_engine", f"ipc://{tmpdir}/from_engine"
        sync_ctx, async_ctx = zmq.Context(), zmq.asyncio.Context()
        push = sync_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)   # never block the event loop; the watchdog catches death
        push.setsockopt(zmq.LINGER, 0)
        push.bind(to_engine)
        pull = async_ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(from_engine)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, to_engine, from_engine, log_level, engine_factory,
                                               frozenset(eos_token_ids)),
            name="radixserve-engine", daemon=True)
        proc.start()
        client = cls(proc, tmpdir, push, pull, sync_ctx, async_ctx, watchdog_timeout_s)
        try:
            client.info = await client._wait_ready()
        except BaseException:
            await client.close()
            raise
        client._tasks = [asyncio.create_task(client._receive_loop(), name="engine-receiver"),
                         asyncio.create_task(client._watchdog(), name="engine-watchdog")]
        return client

    async def _wait_ready(self) -> EngineInfo:
        while True:
            if await self.pull.poll(int(WATCHDOG_INTERVAL_S * 1000)):
                msg = self._decoder.decode(await self.pull.recv())
                if isinstance(msg, Ready):
                    await self._wait_push_connected()
                    return msg.info
                if isinstance(msg, Fatal):
                    raise RuntimeError(f"engine failed to start:\n{msg.message}")
                logger.warning("ignoring %s before the engine is ready", type(msg).__name__)
            elif not self.proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self.proc.exitcode} "
                                   "before it was ready")

    async def _wait_push_connected(self) -> None:
        while not self.push.poll(0, zmq.POLLOUT):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self.proc.exitcode} "
                                   "right after it was ready")
            await asyncio.sleep(0.01)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def submit(self, adds: list[AddReq]) -> RequestStream:
        """Send one HTTP request's engine requests as a group, all or nothing (a failed submit
        holds no open-request slot). Raises EngineDead, or InvalidRequest for an unencodable field."""
        assert adds, "a group holds at least one request"
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        stream = RequestStream(self, adds[0].request_id, [a.request_id for a in adds])
        self._streams[stream.group_id] = stream
        try:
            for add in adds:
                self._routes[add.request_id] = stream
            self._send(adds)
        except (OverflowError, msgspec.EncodeError) as exc:
            self._unregister(stream, adds)
            raise InvalidRequest(f"a request field cannot be represented for the engine: {exc}") from None
        except BaseException:
            self._unregister(stream, adds)
            raise
        return stream

    def _unregister(self, stream: RequestStream, adds: list[AddReq]) -> None:
        stream.unfinished.clear()
        if self._streams.get(stream.group_id) is stream:
            del self._streams[stream.group_id]
        for add in adds:
            if self._routes.get(add.request_id) is stream:
                del self._routes[add.request_id]

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        if self.dead_reason is None and request_ids:
            self._send(Abort(request_ids, reason))

    def unroute(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._routes.pop(rid, None)

    def release(self, stream: RequestStream, leftover: list[str]) -> None:
        self._streams.pop(stream.group_id, None)
        self.unroute(leftover)
        self.abort(leftover)

    async def call(self, method: str, timeout_s: float = 60.0,
                   args: dict[str, Any] | None = None) -> Any:
        """`method(**args)` in the engine process (engine/loop.py). Raises EngineDead,
        asyncio.TimeoutError, the engine's RadixServeError, or RuntimeError with its error."""
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(Call(call_id, method, args or {}))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: Any) -> None:
        self.push.send(self._encoder.encode(msg), zmq.NOBLOCK)

    async def _receive_loop(self) -> None:
        try:
            while True:
                data = await self.pull.recv()
                self.last_heard_s = time.monotonic()
                self._dispatch(self._decoder.decode(data))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # without this task no request can finish: fail them all
            logger.exception("engine receiver failed")
            self._die(f"engine receiver failed: {type(exc).__name__}: {exc}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, list):
            for out in msg:
                stream = self._routes.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._routes[out.request_id]
                stream.queue.put_nowait(out)
        elif isinstance(msg, Submitted):
            stream = self._streams.get(msg.group_id)
            if stream is not None:
                if msg.error is not None:
                    self.unroute(sorted(stream.unfinished))
                stream.queue.put_nowait(msg)
        elif isinstance(msg, CallResult):
            self._resolve_call(msg)
        elif isinstance(msg, Fatal):
            logger.error("engine crashed:\n%s", msg.message)
            self._die(f"engine crashed: {msg.message.strip().splitlines()[-1]}")

    def _resolve_call(self, msg: CallResult) -> None:
        fut = self._calls.get(msg.call_id)
        if fut is None or fut.done():
            return
        if msg.wire_error is not None:
            fut.set_exception(error_from_wire(msg.wire_error))
        elif msg.error is not None:
            fut.set_exception(RuntimeError(msg.error))
        else:
            fut.set_result(msg.value)

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.proc.is_alive():
                self._die(f"engine process exited with code {self.proc.exitcode}")
            elif self._work_pending() and self._silent_s() > self.watchdog_timeout_s:
                self._die(f"engine sent nothing for {self._silent_s():.0f} s with work pending "
                          "(a step never ended); killing it")
                self.proc.kill()

    def _work_pending(self) -> bool:
        return bool(self._streams or self._calls)

    def _silent_s(self) -> float:
        return time.monotonic() - self.last_heard_s

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.dead.set()
        logger.error("engine is dead: %s", reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(_Dead(reason))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))

    async def close(self) -> None:
        """Stop the engine process (politely, then by force); idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self.proc.join, SHUTDOWN_TIMEOUT_S)
            if self.proc.is_alive():
                logger.warning("engine did not stop in %.0f s; terminating it", SHUTDOWN_TIMEOUT_S)
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 5.0)
        self.push.close(0)
        self.pull.close(0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
