"""/health while every request slot is held: 503 `degraded` (the router routes away), which the ops agent reads as busy, not sick."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from fastapi.testclient import TestClient

from radixserve.agent.observe import Observer
from radixserve.server.app import build_app
from radixserve.server.serving import ServingContext
from radixserve.server_config import ServerConfig


def app_with(num_open: int, max_open: int = 3) -> TestClient:
    client = SimpleNamespace(is_alive=True, dead_reason=None, num_open_requests=num_open)
    ctx = ServingContext(client, tokenizer=None, model_name="m", model_path="m", max_open_requests=max_open)
    return TestClient(build_app(ctx, ServerConfig()))


def test_health_is_ok_with_a_free_slot_and_degraded_when_all_are_held():
    ok = app_with(2).get("/health").json()
    assert ok == {"status": "ok", "instance_id": ok["instance_id"]}
    other = app_with(2).get("/health").json()["instance_id"]
    assert len(ok["instance_id"]) == 32 and ok["instance_id"] != other  # one per process
    full = app_with(3).get("/health")
    assert full.status_code == 503
    assert full.json() == {"status": "degraded", "reason": "all 3 request slots are held", "num_open_requests": 3}


def test_the_agent_sees_a_degraded_or_draining_worker_as_answering_and_a_503_error_as_unhealthy():
    bodies = {"http://busy": httpx.Response(503, json={"status": "degraded", "reason": "x"}),
              "http://dead": httpx.Response(503, json={"error": {"type": "engine_dead"}}),
              "http://draining": httpx.Response(503, json={"status": "draining", "reason": "x"}),
              "http://ok": httpx.Response(200, json={"status": "ok"})}

    def answer(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}"
        return bodies[base] if request.url.path == "/health" else httpx.Response(404)

    async def read() -> dict[str, bool]:
        observer = Observer(admin=None, timeout_s=5.0)
        observer.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        snaps = [await observer.worker({"url": url}) for url in bodies]
        await observer.http.aclose()
        return {s.url: s.health_ok for s in snaps}

    assert asyncio.run(read()) == {"http://busy": True, "http://dead": False,
                                   "http://draining": True, "http://ok": True}
