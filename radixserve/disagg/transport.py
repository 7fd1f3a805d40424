"""KV transport: messages over one ordered stream per (decode, prefill) pair, over ZeroMQ/TCP (RDMA seam: docs/disaggregation.md)."""
from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import zmq

from radixserve.disagg.protocol import ToDecode, ToPrefill

logger = logging.getLogger(__name__)

SNDHWM = 1000


class TransportError(RuntimeError):
    """A message could not be handed to the transport (peer unreachable, queue full)."""


class PrefillEndpoint(Protocol):
    address: str    # where decode workers reach it, tcp://host:port

    def recv(self) -> list[tuple[bytes, ToPrefill]]:
        """Every message received so far, as (peer id, message); never blocks."""
        ...

    def send(self, peer: bytes, msg: ToDecode) -> None: ...

    def wait(self, timeout_ms: int) -> bool:
        """Block up to timeout_ms for a message; True when one is there."""
        ...

    def close(self) -> None: ...


class DecodeEndpoint(Protocol):
    def send(self, address: str, msg: ToPrefill) -> None: ...

    def recv(self) -> list[ToDecode]: ...

    def wait(self, timeout_ms: int) -> bool: ...

    def close(self) -> None: ...


class TcpPrefillEndpoint:
    """ROUTER socket bound on host:port (port 0: any free port; `address` says which)."""

    def __init__(self, host: str, port: int):
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, SNDHWM)
        if port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self.port = port
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToPrefill)

    def recv(self) -> list[tuple[bytes, ToPrefill]]:
        out = []
        while True:
            try:
                peer, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append((peer, self._dec.decode(data)))
            except msgspec.DecodeError:
                logger.warning("dropped an undecodable message from a decode peer")

    def send(self, peer: bytes, msg: ToDecode) -> None:
        """Raises zmq.ZMQError when the peer is gone."""
        self.socket.send_multipart([peer, self._enc.encode(msg)])

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(0)
        self._ctx.term()


class TcpDecodeEndpoint:
    """One DEALER socket per prefill address, connected on first use."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToDecode)

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.connect(address)
            self._sockets[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def send(self, address: str, msg: ToPrefill) -> None:
        """In order per address. Raises TransportError for a malformed address or a full queue."""
        try:
            self._socket(address).send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransportError(f"{address}: {exc}") from None

    def recv(self) -> list[ToDecode]:
        out = []
        for sock in self._sockets.values():
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append(self._dec.decode(data))
                except msgspec.DecodeError:
                    logger.warning("dropped an undecodable message from a prefill peer")
        return out

    def wait(self, timeout_ms: int) -> bool:
        return bool(self._sockets) and bool(self._poller.poll(timeout_ms))

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._ctx.term()
