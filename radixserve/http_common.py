"""Pieces every HTTP process shares (worker, router, agent): bearer-key checks, port binding, quiet signals."""
from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import signal
import socket
import threading
from typing import Any, Callable, Iterator

from starlette.requests import Request

from radixserve.errors import Unauthorized

logger = logging.getLogger(__name__)


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
