"""The router's client to workers: httpx's API over aiohttp's connection pool and C parser (docs/benchmarks.md, router overhead), or httpx's own transport when aiohttp is missing."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from radixserve.http_common import CLIENT_KEEP_ALIVE_S

try:
    import aiohttp
except ImportError:
    aiohttp = None


def upstream_transport() -> AiohttpTransport | None:
    """The fast transport, or None (httpx's default) without aiohttp."""
    return AiohttpTransport() if aiohttp is not None else None


def _transport_error(exc: BaseException) -> httpx.TransportError:
    """aiohttp's errors as the httpx errors the router handles (all TransportError)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(str(exc))
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(str(exc) or "no data within the read timeout")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc))
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                        aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(str(exc))
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(str(exc))
    return httpx.ReadError(f"{type(exc).__name__}: {exc}")


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closing it before its end closes the connection."""

    def __init__(self, response: Any):
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from exc

    async def aclose(self) -> None:
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session, made in the event loop: no connection limit, idle connections kept
    CLIENT_KEEP_ALIVE_S, no cookies, bodies undecoded, the connect, read and pool timeouts (s)."""

    def __init__(self) -> None:
        self.session: Any = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        return await self.send(request.method, str(request.url), request.headers.multi_items(),
                               request.content, timeout.get("pool"), timeout.get("connect"),
                               timeout.get("read"), request)

    def poster(self, connect_s: float, read_s: float) -> Callable[..., Awaitable[httpx.Response]]:
        """post(url, body, bytes headers) -> response, body unread: Forwarder.post minus httpx request/cookie logic."""
        async def post(url: str, body: bytes, headers: dict[str, bytes]) -> httpx.Response:
            return await self.send("POST", url, [(k, _text(v)) for k, v in headers.items()],
                                   body, connect_s, connect_s, read_s)
        return post

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
                   pool_s: float | None, connect_s: float | None, read_s: float | None,
                   request: httpx.Request | None = None) -> httpx.Response:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        try:
            response = await self.session.request(
                method, url, headers=headers, data=body or None, allow_redirects=False,
                skip_auto_headers=("Content-Type",),
                timeout=aiohttp.ClientTimeout(connect=pool_s, sock_connect=connect_s, sock_read=read_s))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from exc
        return httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response),
                              request=request)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def _text(value: bytes) -> str:
    """A header value for aiohttp, which writes UTF-8: exact unless the bytes are not UTF-8."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")
