"""HostKV: the host-memory tier of KV pages (--enable-hierarchical-cache) and the copies between it and the device KVCache.

Which pages move, and when, is the engine's business (engine/hicache.py); this module only
copies, and owns the protocol that makes an asynchronous load safe to read:

- **Backup** (device -> host): synchronous, on the scheduler thread, after the pages were
  computed (write-through) or while they are evicted (write-back).
- **Load** (host -> device): asynchronous, one layer at a time on one loader thread, so a
  forward pass can run layer 0 while later layers still copy (SGLang's layer-wise HiCache
  load). `load()` marks every layer as being filled (KVCache.begin_fill) *before* it returns,
  on the scheduler thread, so no read of the target pages can come before the copy; the loader
  ends each layer's fill after copying it, and every read waits for its layer
  (KVCache.wait_ready). A layer that fails still ends its fill (readers never hang) and marks
  the load failed: the engine then discards whatever read those pages and recomputes.
- On CUDA the loader copies on its own stream and synchronises it before ending a layer's
  fill (untested here: no GPU on the development machines).

Fault seam: `fault` (None: off), a CopyFault that fault injection installs
(chaos/tier_faults.py).
"""
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
    """One host -> device load. `done` is set once every layer has ended its fill."""

    num_pages: int
    num_bytes: int
    done: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    seconds: float = 0.0        # enqueue to done, wall time

    def wait(self) -> None:
        self.done.wait()


class CopyFault(Protocol):
    """What HostKV consults when a fault is installed."""

    def before_load_layer(self, layer: int) -> None:
        """On the loader thread, before copying `layer`: may sleep; raising fails the load."""
        ...

    def before_backup(self) -> None:
        """Before a device->host backup: may sleep."""
        ...


class HostKV:
    """`num_pages` host pages shaped like `device`'s (stored dtype, scales and side buffers
    included). Implements the engine's KVTierIO protocol (engine/hicache.py)."""

    def __init__(self, device: KVCache, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the host KV tier needs at least one page, got {num_pages}")
        self.device = device
        self.host = device.like(num_pages, "cpu")
        self.num_pages = num_pages
        self.page_bytes = KVCache.bytes_per_token(device.num_layers, device.num_kv_heads,
                                                  device.head_dim, device.dtype) * device.page_size
        self.fault: CopyFault | None = None
        self.disk = None          # runner/disk_kv.py's DiskKV under --hicache-storage-dir
        self._stream = torch.cuda.Stream(device.device) if device.device.type == "cuda" else None
        self._queue: queue.Queue[tuple[LoadHandle, list[int], list[int], float]] = queue.Queue()
        self._thread = threading.Thread(target=self._loader, name="hicache-loader", daemon=True)
        self._thread.start()

    # ---- device -> host ------------------------------------------------------------------------
    def backup(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pages into host pages, every layer, now. The device pages must hold
        finished KV (no fill in flight)."""
        if self.fault is not None:
            self.fault.before_backup()
        for layer in range(self.device.num_layers):
            self.host.copy_layer_from(self.device, layer, device_ids, host_ids)

    # ---- host -> device ------------------------------------------------------------------------
    def load(self, host_ids: list[int], device_ids: list[int]) -> LoadHandle:
        """Start copying host pages into device pages, layer by layer, in the background.
        Every layer is marked as being filled before this returns (see module doc)."""
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
                except Exception as exc:   # a failed layer fails the load; readers still go on
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
