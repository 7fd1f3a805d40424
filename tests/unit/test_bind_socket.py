"""bind_socket (the worker's listening socket): connections asyncio accepts on it have TCP_NODELAY set.

Without it a response written in two parts (uvicorn writes headers, then the body) waits for the client's
delayed ACK: every worker request took ~40 ms more (docs/benchmarks.md, "Request latency")."""
from __future__ import annotations

import asyncio
import socket

from radixserve.http_common import bind_socket


async def accepted_nodelay() -> int:
    sock = bind_socket("127.0.0.1", 0)
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    port = sock.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(seen, 10)
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


def test_accepted_connections_have_tcp_nodelay():
    assert asyncio.run(accepted_nodelay()) != 0


def test_the_listening_socket_is_tcp():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.type == socket.SOCK_STREAM
    finally:
        sock.close()
