"""The router's aiohttp transport against a raw loopback HTTP/1.1 server: bytes, streams, connection reuse and close, and httpx's error types."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import httpx
import pytest

from radixserve.bench.launch import free_ports
from radixserve.router.proxy import UNREACHABLE
from radixserve.router.upstream import AiohttpTransport


EOF = object()


class Server:
    """Answers each request with `script(path)`: a list of byte strings written in turn; None
    closes the connection, an asyncio.Event waits for it, EOF waits for the client to close.
    Records connections, request heads and bodies, and whether the client closed its end."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.client_closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                for part in self.script(head.split(b" ")[1].decode()):
                    if part is None:
                        return
                    if part is EOF:
                        assert await reader.read() == b""
                        self.client_closed.set()
                        return
                    if isinstance(part, asyncio.Event):
                        await part.wait()
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_closed.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(server: Server) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()


def client(read_s: float = 30.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(), trust_env=False,
                             timeout=httpx.Timeout(connect=5.0, read=read_s, write=5.0, pool=5.0))


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r\xe91\r\nContent-Length: 11\r\n\r\n{\"ok\": 1.0}"
CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_bytes_pass_unchanged_and_the_connection_is_reused():
    server = Server(lambda path: [OK])
    async with serving(server) as url, client() as http:
        for _ in range(3):
            r = await http.post(url + "/v1/completions", content=b'{"prompt": "hi"}',
                                headers={"content-type": "application/json", "x-request-id": "a"})
            assert r.status_code == 200 and r.content == b'{"ok": 1.0}'
            assert r.headers.raw[1] == (b"X-Request-Id", b"r\xe91")
    assert server.connections == 1
    assert server.bodies == [b'{"prompt": "hi"}'] * 3
    assert b"POST /v1/completions HTTP/1.1" in server.heads[0] and b"x-request-id: a" in server.heads[0].lower()


async def test_a_stream_is_read_as_it_arrives():
    more = asyncio.Event()
    server = Server(lambda path: [CHUNKED, chunk(b"data: 1\n\n"), more, chunk(b"data: 2\n\n"), b"0\r\n\r\n"])
    async with serving(server) as url, client() as http:
        async with http.stream("POST", url + "/s", content=b"{}") as r:
            assert r.headers["content-type"] == "text/event-stream"
            chunks = r.aiter_raw()
            assert await anext(chunks) == b"data: 1\n\n"   # before the server sends the rest
            more.set()
            assert b"".join([c async for c in chunks]) == b"data: 2\n\n"


async def test_closing_a_stream_before_its_end_closes_the_connection():
    server = Server(lambda path: [CHUNKED, chunk(b"data: 1\n\n"), EOF])
    async with serving(server) as url, client() as http:
        async with http.stream("POST", url + "/s", content=b"{}") as r:
            assert await anext(r.aiter_raw()) == b"data: 1\n\n"
        await asyncio.wait_for(server.client_closed.wait(), 30)


async def test_a_body_cut_short_is_a_transport_error():
    server = Server(lambda path: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"par", None])
    async with serving(server) as url, client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url + "/v1/completions", content=b"{}")


async def test_no_answer_is_a_transport_error():
    server = Server(lambda path: [None])
    async with serving(server) as url, client() as http:
        with pytest.raises(UNREACHABLE):
            await http.post(url + "/v1/completions", content=b"{}")


async def test_silence_is_a_read_timeout():
    server = Server(lambda path: [asyncio.Event()])
    async with serving(server) as url, client(read_s=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url + "/v1/completions", content=b"{}")


async def test_a_closed_port_is_a_connect_error():
    async with client() as http:
        with pytest.raises(httpx.ConnectError):
            await http.post(f"http://127.0.0.1:{free_ports(1)}/v1/completions", content=b"{}")


async def test_the_routers_post_sends_the_headers_it_is_given():
    server = Server(lambda path: [OK])
    transport = AiohttpTransport()
    post = transport.poster(connect_s=5.0, read_s=30.0)
    async with serving(server) as url:
        try:
            r = await post(url + "/v1/completions", b"{}", {"x-request-id": "id-\u00e9".encode()})
            assert r.status_code == 200 and await r.aread() == b'{"ok": 1.0}'
            await r.aclose()
        finally:
            await transport.aclose()
    head = server.heads[0].lower()
    assert b"x-request-id: id-\xc3\xa9\r\n" in head and b"content-type" not in head
