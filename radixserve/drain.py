"""Graceful drain of our HTTP servers (worker and router): stop admitting, let what is in flight finish, cut off what the grace period leaves, then exit (docs/drain.md).

    admitting --/admin/drain--> draining --/admin/undrain--> admitting
    admitting, draining --SIGTERM/SIGINT--> shutting down --idle or grace_s--> exit 0"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from starlette.responses import JSONResponse

from radixserve.errors import Draining

logger = logging.getLogger(__name__)

FLUSH_S = 5.0   # s for cut-off answers to leave; also uvicorn's timeout_graceful_shutdown
HEALTH_PATH = "/health"


@dataclass(slots=True)
class _Reply:

    started: bool = False
    is_sse: bool = False
    ended: bool = False
    at_event_boundary: bool = True   # the last chunk ended with "\n\n"

    def note(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers") or [])
            self.is_sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self.at_event_boundary = body.endswith(b"\n\n")
            self.ended = not message.get("more_body", False)


@dataclass
class Drain:
    """Admission and in-flight POST /v1/* accounting, until the last byte; event-loop only."""

    grace_s: float
    reason: str | None = None
    is_shutting_down: bool = False
    _active: set[anyio.CancelScope] = field(default_factory=set, init=False, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _shutdown: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _forced: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ValueError(f"graceful shutdown timeout must be >= 0 s, got {self.grace_s}")
        self._idle.set()

    @property
    def is_draining(self) -> bool:
        return self.reason is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    def start(self, reason: str) -> None:
        """Idempotent; the first reason is kept."""
        if self.reason is None:
            self.reason = reason
            logger.warning("draining (%s): new requests get 503, %d in flight run on",
                           reason, self.num_in_flight)

    def stop(self) -> bool:
        """Admit again; False, changing nothing, once shutting down."""
        if self.is_shutting_down:
            return False
        if self.reason is not None:
            logger.warning("admitting again (was draining: %s)", self.reason)
        self.reason = None
        return True

    def shut_down(self, reason: str) -> None:
        self.start(reason)
        self.is_shutting_down = True
        self._shutdown.set()

    async def wait_shutdown(self) -> None:
        await self._shutdown.wait()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def cut_off(self, forced: bool = False) -> int:
        """Cancel every request in flight (DrainMiddleware answers them; `forced`: a second interrupt, not the grace
        period, ended them); returns how many."""
        self._forced = self._forced or forced
        for scope in self._active:
            scope.cancel()
        return len(self._active)

    def cut_off_error(self) -> Draining:
        why = ("a second interrupt stopped it at once" if self._forced else
               f"its grace period of {self.grace_s:g} s (--graceful-shutdown-timeout) ran out")
        return Draining(f"The server shut down before this request finished: {why}. Retry it.")

    def to_json(self) -> dict:
        return {"status": "draining" if self.is_draining else "ok", "reason": self.reason,
                "num_in_flight": self.num_in_flight, "shutting_down": self.is_shutting_down}

    def _enter(self, scope: anyio.CancelScope) -> None:
        self._active.add(scope)
        self._idle.clear()

    def _leave(self, scope: anyio.CancelScope) -> None:
        self._active.discard(scope)
        if not self._active:
            self._idle.set()


class DrainMiddleware:
    """Draining: 503 to POST /v1/*, /health; else tracks POST /v1/*; cut-off: JSON 503 or SSE error + `data: [DONE]`."""

    def __init__(self, app: Any, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.is_draining and scope["path"] == HEALTH_PATH:
            await JSONResponse(drain.to_json(), status_code=503)(scope, receive, send)
        elif scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
        elif drain.is_draining:
            error = Draining(f"The server is draining ({drain.reason}) and admits no new "
                             "request; send it to another server.")
            await JSONResponse(error.to_dict(), status_code=error.status)(scope, receive, send)
        else:
            await self._track(scope, receive, send)

    async def _track(self, scope: Any, receive: Any, send: Any) -> None:
        reply = _Reply()

        async def noted_send(message: dict) -> None:
            reply.note(message)
            await send(message)

        cancel = anyio.CancelScope()
        self.drain._enter(cancel)
        try:
            with cancel:
                await self.app(scope, receive, noted_send)
            if cancel.cancelled_caught:
                await self._answer_cut_off(reply, scope, receive, send)
        finally:
            self.drain._leave(cancel)

    async def _answer_cut_off(self, reply: _Reply, scope: Any, receive: Any, send: Any) -> None:
        error = self.drain.cut_off_error()
        if not reply.started:
            await JSONResponse(error.to_dict(), status_code=error.status)(scope, receive, send)
        elif reply.is_sse and not reply.ended:
            gap = b"" if reply.at_event_boundary else b"\n\n"
            event = b"data: " + json.dumps(error.to_dict()).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": gap + event + b"data: [DONE]\n\n",
                        "more_body": False})
        elif not reply.ended:
            logger.warning("%s cut off mid-body; its connection is closed", scope["path"])


class GracefulServer(uvicorn.Server):
    """SIGINT/SIGTERM starts `drain`'s shutdown, a 2nd SIGINT cuts off what is in flight and stops; needs
    timeout_graceful_shutdown=FLUSH_S."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(self._exit_when_drained())
        try:
            await super().serve(sockets)
        finally:
            waiter.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        assert self._loop is not None, "uvicorn catches signals only inside serve()"
        if self.drain.is_shutting_down:
            if sig == signal.SIGINT:
                logger.warning("second interrupt: stopping now, without waiting")
                self._loop.call_soon_threadsafe(self.drain.cut_off, True)   # 503s now, not uvicorn's cancelled 500s
                super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self.drain.shut_down, signal.Signals(sig).name)

    async def _exit_when_drained(self) -> None:
        drain = self.drain
        await drain.wait_shutdown()
        logger.warning("shutting down: %d request(s) in flight get up to %g s to finish "
                       "(--graceful-shutdown-timeout)", drain.num_in_flight, drain.grace_s)
        if not await drain.wait_idle(drain.grace_s):
            num = drain.cut_off()
            logger.warning("grace period of %g s is over: %d request(s) cut off with a 503 "
                           "error", drain.grace_s, num)
            if not await drain.wait_idle(FLUSH_S):
                logger.warning("%d cut-off request(s) still open after %g s",
                               drain.num_in_flight, FLUSH_S)
        logger.info("drained; stopping")
        self.should_exit = True
