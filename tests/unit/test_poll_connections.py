"""Pollers (the ops agent, the router's health checks) do not take a pooled connection the server
dropped for a sick server, and still see a server that drops every request as down."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from radixserve.agent.observe import Observer
from radixserve.router.state import build_state
from radixserve.router.client import AsyncRouterAdminClient
from radixserve.router.config import RouterConfig

INFO = {"engine": {"num_running": 3, "num_waiting": 2, "token_usage": 0.5}}
BODIES = {"/health": {"status": "ok"}, "/get_server_info": INFO,
          "/admin/workers": {"workers": []}, "/v1/completions": {"choices": []}}


class DroppingServer:
    """HTTP/1.1 on loopback that answers the first `answered_per_connection` requests of each
    connection and closes it, unanswered, on the next one: what a server does when its idle
    keep-alive runs out just as a pooled connection is reused, made to happen every time."""

    def __init__(self, answered_per_connection: int):
        self.answered_per_connection = answered_per_connection
        self.num_answered = 0
        self.num_dropped = 0
        self.open: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        self.open[asyncio.current_task()] = writer
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if answered == self.answered_per_connection:
                    self.num_dropped += 1
                    return
                path = head.split(" ", 2)[1]
                body = json.dumps(BODIES.get(path, {})).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                answered += 1
                self.num_answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return   # the client closed the connection, or serving() did
        finally:
            writer.close()
            self.open.pop(asyncio.current_task(), None)


@contextlib.asynccontextmanager
async def serving(server: DroppingServer) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()
        for writer in server.open.values():
            writer.close()   # ends each handler's read, so none is left pending
        await asyncio.gather(*server.open)


def test_the_agent_reads_a_worker_whose_pooled_connections_were_dropped_as_healthy():
    server = DroppingServer(answered_per_connection=1)

    async def sweeps() -> list:
        observer = Observer(admin=None, timeout_s=5.0)
        try:
            async with serving(server) as url:
                snaps = [await observer.worker({"url": url}) for _ in range(3)]
                probe = await observer.probe(url, None, 5.0, 4)
                return snaps + [probe]
        finally:
            await observer.aclose()

    *snaps, probe = asyncio.run(sweeps())
    assert [(s.health_ok, s.health_error) for s in snaps] == [(True, None)] * 3
    assert all(s.info == INFO for s in snaps)
    assert probe.latency_s is not None
    assert server.num_dropped >= 3   # the later sweeps really went out on reused connections


def test_a_worker_that_drops_every_request_is_still_unhealthy():
    server = DroppingServer(answered_per_connection=0)

    async def sweep():
        observer = Observer(admin=None, timeout_s=5.0)
        try:
            async with serving(server) as url:
                return await observer.worker({"url": url})
        finally:
            await observer.aclose()

    snap = asyncio.run(sweep())
    assert not snap.health_ok and "RemoteProtocolError" in snap.health_error
    assert server.num_dropped == 6 and server.num_answered == 0   # 3 reads, each sent twice


def test_router_health_checks_pass_on_dropped_pooled_connections():
    server = DroppingServer(answered_per_connection=1)
    cfg = RouterConfig(health_failure_threshold=1)   # one failed check would take it out

    async def checks() -> tuple[list[bool], list[int]]:
        async with serving(server) as url:
            state = build_state(cfg, [url], None)   # the router's own client and monitor
            try:
                worker = state.registry.list()[0]
                passed = [await state.monitor.check(worker) for _ in range(3)]
                passed.append(worker.healthy)
                num_running = []
                for _ in range(2):
                    worker.num_running = 0
                    await state.monitor.poll(worker)
                    num_running.append(worker.num_running)
                return passed, num_running
            finally:
                await state.monitor.stop()
                await state.http.aclose()

    assert asyncio.run(checks()) == ([True, True, True, True], [3, 3])
    assert server.num_dropped >= 2


def test_the_agents_router_reads_survive_a_dropped_pooled_connection():
    server = DroppingServer(answered_per_connection=1)

    async def reads() -> list:
        async with serving(server) as url:
            async with AsyncRouterAdminClient(url) as admin:
                return [await admin.list_workers() for _ in range(3)]

    assert asyncio.run(reads()) == [[], [], []]
    assert server.num_dropped >= 1
