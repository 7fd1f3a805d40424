"""RouterAdminClient: a thin sync and async httpx wrapper over the router's admin API (for the ops agent)."""
from __future__ import annotations

from typing import Any, Callable

import httpx

from radixserve.http_common import fresh_client, poller_limits, send_resending_once


class RouterAdminError(Exception):
    """An admin call's error `status`; `body` is the error body ({"raw": text} if not JSON)."""

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
    """The admin calls; `_call` is sync or async (then each returns an awaitable)."""

    def _call(self, method: str, path: str, body: dict | None,
              transform: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def list_workers(self) -> Any:
        return self._call("GET", "/admin/workers", None, _workers)

    def get_policy(self) -> Any:
        return self._call("GET", "/admin/policy", None, _same)

    def add_worker(self, url: str, weight: float | None = None) -> Any:
        body: dict[str, Any] = {"url": url}
        if weight is not None:
            body["weight"] = weight
        return self._call("POST", "/admin/add_worker", body, _same)

    def remove_worker(self, url: str) -> Any:
        return self._call("POST", "/admin/remove_worker", {"url": url}, _same)

    def drain(self, url: str, by: str | None = None) -> Any:
        """`by`: who drains (router/worker.py DRAIN_OWNERS); None: the operator."""
        body = {"url": url} if by is None else {"url": url, "by": by}
        return self._call("POST", "/admin/drain", body, _same)

    def undrain(self, url: str, by: str | None = None) -> Any:
        """`by`: who undrains; "agent" is refused (409) on a worker the operator drained."""
        body = {"url": url} if by is None else {"url": url, "by": by}
        return self._call("POST", "/admin/undrain", body, _same)

    def set_weight(self, url: str, weight: float) -> Any:
        """Load is divided by `weight`; 0 takes the worker out of routing."""
        return self._call("POST", "/admin/set_weight", {"url": url, "weight": weight}, _same)

    def set_policy_params(self, **params: float) -> Any:
        return self._call("POST", "/admin/set_policy_params", params, _same)


class RouterAdminClient(_AdminCalls):
    """Raises RouterAdminError on an error status, httpx.TransportError if unreachable."""

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
    """A GET that fails on a dead pooled connection is sent once more; changes once."""

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
