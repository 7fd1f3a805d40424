"""Pieces every HTTP process shares (worker, router, agent): error bodies, disconnects, timeouts, auth, sockets, keep-alive."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import h11
import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.config import REQUEST_READ_TIMEOUT_S
from radixserve.errors import (BodyTooLarge, InvalidRequest, RadixServeError, RequestTimeout, Unauthorized,
                               error_body)

logger = logging.getLogger(__name__)

SERVER_KEEP_ALIVE_S = 5       # s, uvicorn's timeout_keep_alive
CLIENT_KEEP_ALIVE_S = 2.0     # s; must stay below SERVER_KEEP_ALIVE_S so a poll never meets a closing connection
# A request on a connection the server had closed or reset.
DEAD_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


LINGER_BYTES = 1 << 20   # bytes of a refused body read and dropped before its 413
LINGER_GAP_S = 0.5       # s; the drop stops at a gap this long between chunks


def check_json_content_type(request: Request) -> None:
    """Raises InvalidRequest (400) unless the request says its body is application/json."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise InvalidRequest("Content-Type must be application/json", param="content-type")


async def read_body(request: Request, max_bytes: int,
                    limit: str = "--max-request-body-bytes") -> bytes:
    """The whole request body; BodyTooLarge (413), naming `limit` (what sets `max_bytes`), once its declared or received
    size passes `max_bytes`. A refused body up to LINGER_BYTES is read on and dropped first, so the client reads the 413
    and not a reset from a socket closed with unread bytes in it; a longer one is refused unread."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    chunks: list[bytes] = []
    stream = request.stream()
    if size <= max_bytes:
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if size > max_bytes:
                break
            chunks.append(chunk)
    if size > max_bytes:
        if size <= LINGER_BYTES:
            await _drop_rest(stream, LINGER_BYTES - size)
        raise BodyTooLarge(f"request body is larger than {max_bytes} bytes ({limit})")
    return b"".join(chunks)


async def _drop_rest(stream: AsyncIterator[bytes], budget: int) -> None:
    """Drop up to `budget` more bytes of `stream` until its end, a LINGER_GAP_S gap, or the client leaves or stalls."""
    with contextlib.suppress(StopAsyncIteration, asyncio.TimeoutError, RequestTimeout, ClientDisconnect):
        while budget > 0:
            budget -= len(await asyncio.wait_for(anext(stream), LINGER_GAP_S))


def install_error_handlers(app: FastAPI, who: str) -> None:
    """OpenAI error bodies: RadixServeError as is (408/413 also close: body unread), bugs a logged 500, gone: 499."""

    @app.exception_handler(RadixServeError)
    async def on_error(request: Request, exc: RadixServeError) -> Response:
        headers = {"Connection": "close"} if isinstance(exc, RequestTimeout | BodyTooLarge) else None
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(request: Request, exc: Exception) -> Response:
        logger.debug("client left %s %s before its response", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal {who} error: {type(exc).__name__}",
                                       "internal_error", 500), status_code=500)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it and raise ClientDisconnected when the client disconnects first.
    Cancelled itself (a drain cut-off), it cancels `work` and closes the ClosingStreamingResponse
    `work` may have made all the same, which then has no taker (it holds a worker's stream)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        watcher.cancel()
        task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
            made = None if task.cancelled() or task.exception() else task.result()
            if isinstance(made, ClosingStreamingResponse):
                await made.close()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class ClosingStreamingResponse(Response):
    """Streams `content` (str as UTF-8), calls `close` (sync or async) however it ends; a disconnect cancels it."""

    def __init__(self, content: AsyncIterable[str | bytes],
                 close: Callable[[], Awaitable[None] | None], status_code: int = 200,
                 headers: dict[str, str] | None = None, media_type: str | None = None):
        self.body_iterator = content
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        ended = cut = False

        def on_disconnect(watcher: asyncio.Task) -> None:
            nonlocal cut
            if not ended and not watcher.cancelled() and watcher.exception() is None:
                cut = task.cancel()

        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_disconnect)
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not cut or task.uncancel() > 0:
                raise
            logger.debug("client left %s mid-stream", scope.get("path"))
        finally:
            ended = True
            watcher.cancel()
            await self.close()

    async def close(self) -> None:
        """Calls the `close` given at construction."""
        closing = self._close()
        if closing is not None:
            await closing


class BodyTimeoutMiddleware:
    """A body stalled `timeout_s` s between chunks raises RequestTimeout (408) in the reader."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"the request body stalled for {self.timeout_s:g} s "
                                     "(--request-body-timeout)") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol where a request's headers and body arrive within `read_timeout_s` s of the connection
    opening or the last response ending, or the connection closes (after a 408 if part came and no response began)."""

    read_timeout_s = REQUEST_READ_TIMEOUT_S
    _read_timer: asyncio.TimerHandle | None = None

    @classmethod
    def bounded(cls, timeout_s: float) -> type[ReadTimeoutProtocol]:
        return type(cls.__name__, (cls,), {"read_timeout_s": timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._time_read()

    def handle_events(self) -> None:
        super().handle_events()
        self._time_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._time_read()

    def _time_read(self) -> None:
        reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
        if reading and self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        elif not reading and self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        started = self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]
        if started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            error = RequestTimeout(f"the request was not received within {self.read_timeout_s:g} s "
                                   "(--request-read-timeout)")
            body = json.dumps(error.to_dict()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def bearer_key_check(key: str | None, what: str = "API key") -> Callable[[Request], Any]:
    """`Authorization: Bearer <key>` (constant-time) or Unauthorized (401); `key` None passes all."""
    async def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise Unauthorized(f"Incorrect or missing {what} (send 'Authorization: Bearer KEY').")
    return check


class PortUnavailable(RuntimeError):
    """host:port cannot be bound."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound like uvicorn's (SO_REUSEADDR), not listening (raises PortUnavailable). Proto IPPROTO_TCP (not
    0), so asyncio sets TCP_NODELAY on accepted connections (or a two-part response awaits a delayed ACK: Nagle)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = ("already in use by another process" if exc.errno == errno.EADDRINUSE
                  else (exc.strerror or str(exc)).lower())
        raise PortUnavailable(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def poller_limits(**kwargs: Any) -> httpx.Limits:
    """httpx.Limits(**kwargs) whose idle connections expire after CLIENT_KEEP_ALIVE_S."""
    return httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S, **kwargs)


def fresh_client(trust_env: bool = True) -> httpx.AsyncClient:
    """A client without idle connections, for send_resending_once's second attempt."""
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), trust_env=trust_env)


async def send_resending_once(client: httpx.AsyncClient, fresh: httpx.AsyncClient, method: str,
                              url: str, **kwargs: Any) -> httpx.Response:
    """The request, resent once through `fresh` on DEAD_CONNECTION_ERRORS (not timeouts); idempotent requests only."""
    request = client.build_request(method, url, **kwargs)
    try:
        return await client.send(request)
    except DEAD_CONNECTION_ERRORS as exc:
        logger.debug("%s %s failed on a dead connection (%s: %s); sending it again on a new one",
                     method, url, type(exc).__name__, exc)
    return await fresh.send(request)


@contextlib.contextmanager
def quiet_signals() -> Iterator[None]:
    """SIGINT/SIGTERM handlers as logged no-ops while uvicorn re-raises signals; no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(sig: int, frame: object) -> None:
        logger.info("stopping on signal %d", sig)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def setup_logging(level: str) -> None:
    """Root logging at `level`; httpx stays at WARNING unless debug (its per-request lines bury events)."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.lower() != "debug":
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
