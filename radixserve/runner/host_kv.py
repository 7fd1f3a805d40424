"""HostKV: the host-memory KV tier (--enable-hierarchical-cache): synchronous backups, layer-wise asynchronous loads (SGLang's HiCache).

A load marks every layer as filling (KVCache.begin_fill) before load() returns, and each layer's
fill ends even when its copy fails, so a reader (KVCache.wait_ready) never runs ahead or hangs."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)


@dataclass
class LoadHandle:
    num_pages: int
    num_bytes: int
    done: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    seconds: float = 0.0

    def wait(self) -> None:
        self.done.wait()


class CopyFault(Protocol):
    def before_load_layer(self, layer: int) -> None:
        """On the loader thread; raising fails the load."""
        ...

    def before_backup(self) -> None:
        ...


class HostKV:
    """engine/hicache.py's KVTierIO over `num_pages` host pages shaped like `device`'s."""

    def __init__(self, device: KVCache, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the host KV tier needs at least one page, got {num_pages}")
        self.device = device
        self.host = device.like(num_pages, "cpu")
        self.num_pages = num_pages
        self.page_bytes = device.slot_bytes * device.page_size
        self.fault: CopyFault | None = None
        self.disk = None
        self._stream = torch.cuda.Stream(device.device) if device.device.type == "cuda" else None
        self._queue: queue.Queue[tuple[LoadHandle, list[int], list[int], float]] = queue.Queue()
        self._thread = threading.Thread(target=self._loader, name="hicache-loader", daemon=True)
        self._thread.start()

    def backup(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy now; the device pages must hold finished KV (no fill in flight)."""
        if self.fault is not None:
            self.fault.before_backup()
        for layer in range(self.device.num_layers):
            self.host.copy_layer_from(self.device, layer, device_ids, host_ids)

    def load(self, host_ids: list[int], device_ids: list[int]) -> LoadHandle:
        assert len(host_ids) == len(device_ids) and host_ids, "load needs matching, non-empty ids"
        handle = LoadHandle(len(host_ids), len(host_ids) * self.page_bytes)
        self.device.begin_fill(range(self.device.num_layers))
        self._queue.put((handle, list(host_ids), list(device_ids), time.perf_counter()))
        return handle

    def _loader(self) -> None:
        while True:
            handle, host_ids, device_ids, start = self._queue.get()
            fault = self.fault
            for layer in range(self.device.num_layers):
                try:
                    if fault is not None:
                        fault.before_load_layer(layer)
                    if not handle.failed:
                        self._copy_layer(layer, host_ids, device_ids)
                except Exception as exc:
                    if not handle.failed:
                        logger.warning("host KV load of %d pages failed at layer %d: %s",
                                       len(host_ids), layer, exc)
                    handle.failed = True
                finally:
                    if layer == self.device.num_layers - 1:
                        handle.seconds = time.perf_counter() - start
                        handle.done.set()   # before the last end_fill: a reader past it sees done
                    self.device.end_fill(layer)

    def _copy_layer(self, layer: int, host_ids: list[int], device_ids: list[int]) -> None:
        if self._stream is None:
            self.device.copy_layer_from(self.host, layer, host_ids, device_ids)
            return
        with torch.cuda.stream(self._stream):
            self.device.copy_layer_from(self.host, layer, host_ids, device_ids)
        self._stream.synchronize()

    def info(self) -> dict:
        return {"host_pages": self.num_pages, "host_page_bytes": self.page_bytes}
