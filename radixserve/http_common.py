"""Pieces every HTTP process shares (worker, router, agent): OpenAI error bodies, the disconnect race,
streams that close their source, the request-body read timeout, bearer-key checks, port
binding, quiet signals, and keep-alive rules for clients that poll our servers."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.errors import RadixServeError, RequestTimeout, Unauthorized, error_body

logger = logging.getLogger(__name__)

#: Our servers (uvicorn) close a connection idle this long, in s (uvicorn.Config timeout_keep_alive).
SERVER_KEEP_ALIVE_S = 5
#: Our pollers (the agent, the router's health checks) drop a pooled connection idle this long,
#: in s. httpx's default equals uvicorn's 5 s, so a poll every 5 s could go out on a connection
#: just as the server closes it, and fail with "Server disconnected without sending a response".
CLIENT_KEEP_ALIVE_S = 2.0
#: How a request fails when the connection under it was dead: closed by the server (idle
#: keep-alive, a restart) or reset. Sending it again, on a new connection, tells whether the
#: server itself is down.
DEAD_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready (race_disconnect)."""


def install_error_handlers(app: FastAPI, who: str) -> None:
    """Errors as OpenAI error bodies: RadixServeError as itself (a 408 also closes the
    connection), 404/405 as not_found_error/invalid_request_error, bugs as a logged 500
    "internal {who} error"; a client gone before its response gets 499, to nobody."""

    @app.exception_handler(RadixServeError)
    async def on_error(request: Request, exc: RadixServeError) -> Response:
        headers = {"Connection": "close"} if isinstance(exc, RequestTimeout) else None
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


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` unless the client (body read) disconnects first: then cancel `work`, let its
    cleanup run and raise ClientDisconnected. Cancelled itself, it cancels `work` too."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `close` (sync or async) however it ends, also when the
    client left before the first chunk (then `content` never starts to clean up itself)."""

    def __init__(self, content: AsyncIterable[str | bytes],
                 close: Callable[[], Awaitable[None] | None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            closing = self._close()
            if closing is not None:
                await closing


class BodyTimeoutMiddleware:
    """ASGI middleware: a request body that stalls `timeout_s` s between two chunks raises
    RequestTimeout (408) in the reader; reads after the last chunk are not timed."""

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


def bearer_key_check(key: str | None, what: str = "API key") -> Callable[[Request], Any]:
    """FastAPI dependency: the request must carry `Authorization: Bearer <key>`, compared in
    constant time; raises Unauthorized (401) otherwise. `key` None: every request passes."""
    async def check(request: Request) -> None:  # the annotation makes FastAPI inject it
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise Unauthorized(f"Incorrect or missing {what} (send 'Authorization: Bearer KEY').")
    return check


class PortUnavailable(RuntimeError):
    """host:port cannot be bound (taken by another process, or an address not on this machine)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port the way uvicorn binds (SO_REUSEADDR, so a port left in
    TIME_WAIT by a previous run is reusable), not yet listening: until uvicorn listens on it
    (`Server.serve(sockets=[sock])`) connections are refused, not queued. Binding before a
    slow start-up makes a taken port fail at once, and nothing can take it in between.
    Raises PortUnavailable naming host:port and the OS's reason."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
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
    """httpx pool limits for a client that polls our servers: idle connections expire after
    CLIENT_KEEP_ALIVE_S, before the server's keep-alive closes them; `kwargs` as httpx.Limits."""
    return httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S, **kwargs)


def fresh_client(trust_env: bool = True) -> httpx.AsyncClient:
    """A client that keeps no idle connection, so every request it sends goes out on a new one:
    the second attempts of send_resending_once. Close it with the poller's own client."""
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), trust_env=trust_env)


async def send_resending_once(client: httpx.AsyncClient, fresh: httpx.AsyncClient, method: str,
                              url: str, **kwargs: Any) -> httpx.Response:
    """`client.request(method, url, **kwargs)`, sent once more on a new connection when the one
    under it turned out dead (DEAD_CONNECTION_ERRORS), so a pooled connection the server closed
    is not taken for a sick server. The second attempt (same URL, headers, body and timeouts)
    goes through `fresh` (see fresh_client), not `client`'s pool, where other idle connections
    may have died the same way. Only for requests that are safe to send twice (health and
    metrics reads, probes). Raises what httpx raises on the second attempt, or on the first for
    any other error (a timeout is not retried: it already took its time)."""
    request = client.build_request(method, url, **kwargs)
    try:
        return await client.send(request)
    except DEAD_CONNECTION_ERRORS as exc:
        logger.debug("%s %s failed on a dead connection (%s: %s); sending it again on a new one",
                     method, url, type(exc).__name__, exc)
    return await fresh.send(request)


@contextlib.contextmanager
def quiet_signals() -> Iterator[None]:
    """uvicorn stops on SIGINT/SIGTERM and then re-raises the signal to the handler it found
    installed; make that handler a logged no-op, so the caller's own shutdown runs in order
    and the exit code is 0. Off the main thread (tests) it does nothing."""
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
    """Root logging at `level` ("debug", "info", ...). httpx logs one INFO line per request,
    which for the router's health and load polls and the agent's sweeps buries every real
    event, so its loggers stay at WARNING unless `level` is debug."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.lower() != "debug":
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
