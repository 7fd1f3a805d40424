"""PD mode of the router: each request goes to a (prefill, decode) pair, both legs at once with a shared bootstrap room, retried and continued on other pairs (docs/disaggregation.md)."""
from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import httpx
from fastapi.responses import JSONResponse, Response

from radixserve.errors import error_body
from radixserve.router.eject import Ejected
from radixserve.router.outcome import anomaly_kind, classify, error_kind, error_of_body, event_status
from radixserve.router.lease import Attempts, Lease
from radixserve.router.relay import Opened, Relay, RelayResponse
from radixserve.router.stream import StreamLedger, error_of, sse_batches

logger = logging.getLogger(__name__)

UNREACHABLE = (httpx.TransportError, httpx.InvalidURL)


@dataclass
class LegFailed:
    """`side`: "prefill" or "decode"; `status` None: transport error; `kind`: the error type; `response`: the client's
    answer if no other pair does better; `anomaly`: the detector of an output_anomaly."""

    side: str
    url: str
    status: int | None
    kind: str | None
    response: Response
    anomaly: str | None = None

    @property
    def retry(self) -> bool:
        return classify(self.status, self.status is None, self.kind).retry


@dataclass
class DecodeOpened:
    """`head`: the whole body (not a 200 stream) or the stream's first content or error event;
    `pending`: the events read up to it; `more`: those read with it; `batches`: the rest (sse_batches)."""

    resp: httpx.Response
    head: bytes
    pending: list[bytes]
    batches: AsyncIterator[list[bytes]] | None = None
    more: list[bytes] = field(default_factory=list)


class PDRouter:
    """`prefill` and `decode`: a RouterState each (registry, policy, forwarder)."""

    def __init__(self, prefill: Any, decode: Any):
        self.prefill = prefill
        self.decode = decode
        self.http: httpx.AsyncClient = prefill.http
        self._bootstrap: dict[str, tuple[str, int]] = {}
        self._lookups: dict[str, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()

    async def bootstrap_of(self, url: str) -> tuple[str, int]:
        """Prefill worker's bootstrap (host, port), cached, lookups shared; LookupError: not prefill or cannot say."""
        cached = self._bootstrap.get(url)
        if cached is not None:
            return cached
        lookup = self._lookups.get(url)
        if lookup is None:
            lookup = self._lookups[url] = asyncio.ensure_future(self._lookup(url))
            lookup.add_done_callback(lambda done: self._lookup_done(url, done))
        return await asyncio.shield(lookup)

    def _lookup_done(self, url: str, lookup: asyncio.Future) -> None:
        """Reading the error keeps asyncio from logging it when every waiter had left."""
        self._lookups.pop(url, None)
        if not lookup.cancelled():
            lookup.exception()

    async def _lookup(self, url: str) -> tuple[str, int]:
        """Answered between engine steps, so the read gets the silence timeout."""
        config = self.prefill.config
        try:
            r = await self.http.get(url + "/get_server_info", timeout=httpx.Timeout(
                config.silence_timeout_s, connect=config.connect_timeout_s))
            info = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise LookupError(f"cannot read {url}/get_server_info: {exc!r}") from None
        address = info.get("bootstrap_address")
        if info.get("disaggregation_mode") != "prefill" or not address:
            raise LookupError(f"{url} is not a prefill worker (--disaggregation-mode prefill)")
        parts = urlsplit(address)
        host = parts.hostname if parts.hostname not in ("0.0.0.0", "::") else urlsplit(url).hostname
        self._bootstrap[url] = (host, parts.port)
        return self._bootstrap[url]

    async def forward(self, path: str, body: dict, headers: dict[str, bytes], key: Any,
                      stream: bool) -> Response:
        tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        attempts = Attempts()
        ledger = None
        if stream:
            ledger = StreamLedger(path, json.dumps(body).encode(), self.prefill.forwarder.migration_on)
            body = json.loads(ledger.first_body())
        answer = await self._dispatch(path, body, headers, key, ledger, tried, attempts)
        if isinstance(answer, Opened):
            async def resend() -> tuple[Opened | None, str]:
                return await self._continue(path, headers, key, ledger, tried, attempts)
            return RelayResponse(Relay(self.prefill.forwarder, ledger, answer, resend))
        if isinstance(answer, LegFailed):
            self.prefill.metrics.retries_exhausted.inc()
            return answer.response
        if answer is not None:
            return answer
        side = "prefill" if not self.prefill.registry.routable() else "decode"
        return _error(503, f"no routable {side} worker", "no_worker_available")

    async def _continue(self, path: str, headers: dict[str, bytes], key: Any, ledger: StreamLedger,
                        tried: dict[str, set[str]], attempts: Attempts) -> tuple[Opened | None, str]:
        """(the continuation opened on another pair or None, the migration outcome)."""
        body = json.loads(ledger.continuation_body())
        result = await self._dispatch(path, body, headers, key, ledger, tried, attempts)
        if isinstance(result, Opened):
            logger.info("PD stream continued on %s after %d tokens", result.lease.worker.url,
                        len(ledger.token_ids))
            return result, "success"
        if isinstance(result, Response):
            logger.warning("PD continuation refused (%d): %s", result.status_code, bytes(result.body)[:200])
            return None, "refused"
        return None, "exhausted"

    async def _dispatch(self, path: str, body: dict, headers: dict[str, bytes], key: Any,
                        ledger: StreamLedger | None, tried: dict[str, set[str]],
                        attempts: Attempts) -> Response | Opened | LegFailed | None:
        """Tries untried pairs -> answer, Opened stream, last LegFailed (budget or workers out), None if none tried."""
        forwarder = self.prefill.forwarder
        last: LegFailed | None = None
        while attempts.made < forwarder.max_attempts:
            p_all = self.prefill.registry.routable(exclude=tried["prefill"])
            d_all = self.decode.registry.routable(exclude=tried["decode"])
            if not p_all or not d_all:
                break
            if attempts.made:
                await asyncio.sleep(forwarder.backoff_s(attempts.made))
                self.prefill.metrics.retries.inc()
            if last is not None and last.anomaly is not None:
                self.prefill.metrics.anomalies.labels(last.anomaly, "retried").inc()
            attempts.made += 1
            p = self.prefill.policy.select(key, p_all).worker
            d = self.decode.policy.select(key, d_all).worker
            answer = await self._attempt(path, body, headers, ledger, p, d)
            if isinstance(answer, Opened):
                tried["decode"].add(d.url)
                return answer
            if not isinstance(answer, LegFailed):
                return answer
            last = answer
            if not answer.retry:
                return answer.response
            tried[answer.side].add(answer.url)
            logger.info("PD attempt %d failed on the %s leg (%s): %s", attempts.made, answer.side,
                        answer.url, answer.status or "transport error")
        if last is not None and last.anomaly is not None:
            self.prefill.metrics.anomalies.labels(last.anomaly, "exhausted").inc()
        return last

    async def _attempt(self, path: str, body: dict, headers: dict[str, bytes],
                       ledger: StreamLedger | None, p: Any, d: Any) -> Response | Opened | LegFailed:
        """Both legs, new bootstrap room -> answer, Opened stream (owns decode lease), failed leg (other cancelled)."""
        try:
            host, port = await self.bootstrap_of(p.url)
        except LookupError as exc:
            self.prefill.forwarder.record(p, None, True)
            return LegFailed("prefill", p.url, None, None, _error(503, str(exc), "no_worker_available"))
        room = random.getrandbits(63)
        extra = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        p_body = {**body, **extra, "stream": False}
        p_body.pop("stream_options", None)
        d_body = {**body, **extra}
        p_lease, lease = Lease(self.prefill.registry, p), Lease(self.decode.registry, d)
        p_leg = asyncio.create_task(self.http.post(p.url + path, json=p_body, headers=headers),
                                    name=f"pd-prefill-{room}")
        p_leg.add_done_callback(lambda _: p_lease.release())   # however the leg ends
        d_leg = asyncio.create_task(self._open_decode(d.url + path, d_body, headers, lease, ledger),
                                    name=f"pd-decode-{room}")
        try:
            answer = await self._race(p_leg, d_leg, p.url, d.url)
        except BaseException:
            p_leg.cancel()
            d_leg.cancel()
            lease.release()
            raise
        if isinstance(answer, LegFailed):
            lease.release()
            if d_leg.done() and not d_leg.cancelled() and d_leg.exception() is None:
                self._keep(asyncio.ensure_future(d_leg.result().resp.aclose()))
            state, worker = (self.prefill, p) if answer.side == "prefill" else (self.decode, d)
            state.forwarder.record(worker, answer.status, answer.status is None, answer.kind)
            return answer
        self.prefill.forwarder.record(p, 200, False)
        self._keep(p_leg)
        if answer.batches is not None:   # the relay records the decode outcome at its end
            return Opened(lease, answer.resp, answer.batches, answer.pending, answer.more)
        self.decode.forwarder.record(d, answer.resp.status_code, False)
        lease.release()
        return Response(answer.head, status_code=answer.resp.status_code,
                        media_type=answer.resp.headers.get("content-type"))

    async def _open_decode(self, url: str, body: dict, headers: dict[str, bytes], lease: Lease,
                           ledger: StreamLedger | None) -> DecodeOpened:
        """Reads a stream through the lease's StreamWatch up to its first unheld event."""
        req = self.http.build_request("POST", url, json=body, headers=headers)
        resp = await self.http.send(req, stream=True)
        try:
            if ledger is None or resp.status_code != 200:
                body_bytes = await resp.aread()
                await resp.aclose()
                return DecodeOpened(resp, body_bytes, [])
            batches = lease.watch().events(sse_batches(resp.aiter_raw()))
            pending: list[bytes] = []
            async for batch in batches:
                for i, event in enumerate(batch):
                    pending.append(event)
                    if not ledger.is_held(event):
                        return DecodeOpened(resp, event, pending, batches, batch[i + 1:])
            return DecodeOpened(resp, pending[-1] if pending else b"", pending, batches)
        except BaseException:
            await resp.aclose()
            raise

    async def _race(self, p_leg: asyncio.Task, d_leg: asyncio.Task, p_url: str, d_url: str):
        """The decode leg's DecodeOpened, or a failed leg's LegFailed (the other cancelled)."""
        pending = {p_leg, d_leg}
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if p_leg in done:
                failure = _leg_failure(p_leg, p_url, "prefill")
                if failure is not None:
                    d_leg.cancel()
                    self._close_later(d_leg)
                    return failure
            if d_leg in done:
                failure = _leg_failure(d_leg, d_url, "decode")
                if failure is not None:
                    p_leg.cancel()
                    return failure
                return d_leg.result()

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _close_later(self, d_leg: asyncio.Task) -> None:
        def close(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None:
                self._keep(asyncio.ensure_future(task.result().resp.aclose()))
        d_leg.add_done_callback(close)


def _leg_failure(leg: asyncio.Task, url: str, side: str) -> LegFailed | None:
    exc = leg.exception()
    if isinstance(exc, (*UNREACHABLE, Ejected)):
        logger.warning("PD %s leg to %s failed: %r", side, url, exc)
        return LegFailed(side, url, None, None, _error(
            502, f"the {side} worker {url} failed: {type(exc).__name__}", "upstream_error"))
    if exc is not None:
        raise exc
    result = leg.result()
    resp, body = (result, result.content) if side == "prefill" else (result.resp, result.head)
    if resp.status_code < 400:
        if side == "decode" and body.startswith(b'data: {"error"'):
            error = error_of(body) or {"message": f"the decode worker {url} sent a malformed error "
                                                  "event", "type": "upstream_error", "code": 502}
            status = event_status(error)
            return LegFailed(side, url, status, error.get("type"),
                             JSONResponse({"error": error}, status_code=status), anomaly_kind(error))
        return None
    if side == "decode" and resp.headers.get("content-type", "").startswith("text/event-stream"):
        body = body.removeprefix(b"data: ").strip()
    logger.info("PD %s leg to %s answered %d", side, url, resp.status_code)
    try:
        content = json.loads(body)
    except ValueError:
        content = error_body(f"the {side} worker answered {resp.status_code}", "upstream_error",
                             resp.status_code)
    return LegFailed(side, url, resp.status_code, error_kind(body),
                     JSONResponse(content, status_code=resp.status_code),
                     anomaly_kind(error_of_body(body)))


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status)
