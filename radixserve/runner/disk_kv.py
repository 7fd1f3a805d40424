"""DiskKV: the disk KV tier (--hicache-storage-dir): one safetensors file per page under DIR/<fingerprint>/, named by its prefix hash chain (engine/hicache_disk.py); written via rename, so never seen half-written."""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from radixserve.runner.kv_cache import KVCache, KVPages

logger = logging.getLogger(__name__)


@dataclass
class FetchHandle:
    """`num_ok` leading pages landed once `done` is set."""

    num_pages: int
    done: threading.Event = field(default_factory=threading.Event)
    num_ok: int = 0
    seconds: float = 0.0


def fingerprint(model_path: str, num_layers: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, page_size: int) -> str:
    """Folder name: KV shapes, dtype, page size and a hash of the model path, size and mtime."""
    st = os.stat(model_path)
    ident = hashlib.sha256(f"{os.path.realpath(model_path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return (f"L{num_layers}-kv{num_kv_heads}x{head_dim}-{str(dtype).removeprefix('torch.')}"
            f"-p{page_size}-{ident.hexdigest()[:16]}")


class DiskKV:
    def __init__(self, host: KVCache, root: str, fingerprint_: str):
        self.host = host
        self.dir = os.path.join(root, fingerprint_)
        os.makedirs(self.dir, exist_ok=True)
        self.index: set[str] = {f[:-len(".safetensors")] for f in os.listdir(self.dir)
                                if f.endswith(".safetensors")}
        self.fetch_limit: Callable[[int], int] | None = None   # fault seam: n -> pages a fetch may read (may stall first)
        self.num_written = self.num_write_errors = 0
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._worker, name="hicache-disk", daemon=True).start()
        logger.info("disk KV tier at %s: %d pages found", self.dir, len(self.index))

    def has(self, name: str) -> bool:
        if name in self.index:
            return True
        if os.path.exists(self._path(name)):
            self.index.add(name)
            return True
        return False

    def write(self, host_ids: list[int], names: list[str]) -> None:
        """Snapshot the host pages now (reusable at once); save them in the background."""
        todo = [(h, n) for h, n in zip(host_ids, names) if n not in self.index]
        if not todo:
            return
        pages = self.host.export_pages([h for h, _ in todo])
        for n in (name for _, name in todo):
            self.index.add(n)
        self._queue.put(("write", pages, [n for _, n in todo], None))

    def fetch(self, names: list[str], host_ids: list[int]) -> FetchHandle:
        """In the background, in order, stopping at the first missing or unreadable page."""
        handle = FetchHandle(len(names))
        self._queue.put(("fetch", None, list(names), (handle, list(host_ids), time.perf_counter())))
        return handle

    def flush(self) -> None:
        self._queue.join()

    def _worker(self) -> None:
        while True:
            op, pages, names, extra = self._queue.get()
            try:
                if op == "write":
                    self._write(pages, names)
                else:
                    self._fetch(names, *extra)
            finally:
                self._queue.task_done()

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name + ".safetensors")

    def _write(self, pages: KVPages, names: list[str]) -> None:
        for i, name in enumerate(names):
            tensors = {"k": pages.k[:, :, i].contiguous(), "v": pages.v[:, :, i].contiguous(),
                       **{f"side.{s}": t[:, i].contiguous() for s, t in pages.side.items()}}
            tmp = f"{self._path(name)}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                save_file(tensors, tmp)
                os.replace(tmp, self._path(name))
                self.num_written += 1
            except OSError as exc:
                self.num_write_errors += 1
                self.index.discard(name)
                logger.warning("disk KV tier: could not write page %s: %s", name[:12], exc)

    def _fetch(self, names: list[str], handle: FetchHandle, host_ids: list[int], start: float) -> None:
        limit = len(names) if self.fetch_limit is None else self.fetch_limit(len(names))
        try:
            for i, (name, host_id) in enumerate(zip(names, host_ids)):
                if i >= limit:
                    break
                try:
                    t = load_file(self._path(name))
                    k, v = t["k"].unsqueeze(2), t["v"].unsqueeze(2)
                    side = {s: t[f"side.{s}"].unsqueeze(1) for s in self.host.side_names}
                    self.host.import_pages([host_id], KVPages(k, v, side))
                except Exception as exc:
                    logger.warning("disk KV tier: page %s unreadable (%s); fetch cut at %d of %d",
                                   name[:12], exc, i, len(names))
                    self.index.discard(name)
                    break
                handle.num_ok = i + 1
        finally:
            handle.seconds = time.perf_counter() - start
            handle.done.set()
