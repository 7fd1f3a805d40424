"""RouterAdminClient: a thin sync and async httpx wrapper over the router's admin API (for the ops agent)."""
from __future__ import annotations

from typing import Any, Callable

import httpx

from radixserve.http_common import fresh_client, poller_limits, send_resending_once


class RouterAdminError(Exception):
    """The router answered an admin call with an error status. `status` is the HTTP status,
    `body` the decoded OpenAI error body (or {"raw": text} when it is not JSON)."""

    def __init__(self, status: int, body: dict):
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        super().__init__(f"router admin call failed with {status}: {message or body}")
        self.status = status
        self.body = body


def _decode(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = {"raw": response.text}
    if response.status_code >= 400:
        raise RouterAdminError(response.status_code, body)
    return body


def _workers(body: dict) -> list[dict]:
    return body["workers"]


def _same(body: Any) -> Any:
    return body


class _AdminCalls:
    """The admin calls, written once; `_call` is sync in RouterAdminClient and async in
    AsyncRouterAdminClient (then every method returns an awaitable)."""

    def _call(self, method: str, path: str, body: dict | None,
              transform: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def list_workers(self) -> Any:
        """Every worker's state (url, healthy, draining, weight, in_flight, load, breaker,
        reported, hit_estimate, num_requests, num_failures): a list of dicts."""
        return self._call("GET", "/admin/workers", None, _workers)

    def get_policy(self) -> Any:
        """{"policy", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold"}."""
        return self._call("GET", "/admin/policy", None, _same)

    def add_worker(self, url: str, weight: float | None = None) -> Any:
        """Register a worker; it gets traffic once its health checks pass."""
        body: dict[str, Any] = {"url": url}
        if weight is not None:
            body["weight"] = weight
        return self._call("POST", "/admin/add_worker", body, _same)

    def remove_worker(self, url: str) -> Any:
        """Deregister a worker (in-flight requests still finish)."""
        return self._call("POST", "/admin/remove_worker", {"url": url}, _same)

    def drain(self, url: str) -> Any:
        """Send the worker no new requests; in-flight ones finish."""
        return self._call("POST", "/admin/drain", {"url": url}, _same)

    def undrain(self, url: str) -> Any:
        """Let a drained worker take requests again."""
        return self._call("POST", "/admin/undrain", {"url": url}, _same)

    def set_weight(self, url: str, weight: float) -> Any:
        """Routing weight (load is divided by it; 0 takes the worker out of routing)."""
        return self._call("POST", "/admin/set_weight", {"url": url, "weight": weight}, _same)

    def set_policy_params(self, **params: float) -> Any:
        """Change cache_threshold / balance_abs_threshold / balance_rel_threshold; returns the
        values in force."""
        return self._call("POST", "/admin/set_policy_params", params, _same)


class RouterAdminClient(_AdminCalls):
    """Blocking client. `base_url` is the router's (http://host:port); `api_key` its admin
    key; `timeout_s` applies to each call. Errors: RouterAdminError for an error status,
    httpx.TransportError when the router cannot be reached."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 10.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, body: dict | None,
              transform: Callable[[Any], Any]) -> Any:
        return transform(_decode(self.http.request(method, path, json=body)))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RouterAdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRouterAdminClient(_AdminCalls):
    """The same calls for asyncio (the ops agent polls with them): every method returns an
    awaitable. A GET that fails on a dead pooled connection is sent once more
    (http_common.send_resending_once); changes are sent once."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 10.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                      timeout=timeout_s, limits=poller_limits())
        self.fresh_http = fresh_client()

    async def _call(self, method: str, path: str, body: dict | None,
                    transform: Callable[[Any], Any]) -> Any:
        if method == "GET":
            response = await send_resending_once(self.http, self.fresh_http, method, path)
        else:
            response = await self.http.request(method, path, json=body)
        return transform(_decode(response))

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.fresh_http.aclose()

    async def __aenter__(self) -> AsyncRouterAdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
