"""DiskKV: the disk tier of KV pages (--hicache-storage-dir), below the host tier: one safetensors file per page, named by a hash chain of its token content.

A page's name is `sha256(previous page's name + this page's token ids)` (engine/hicache_disk.py
computes it), so a name says the whole prefix up to and including the page: two workers on one
host that computed the same prefix write the same file, and a restarted worker finds its old
pages again. Files live under `DIR/<fingerprint>/`, the fingerprint naming the model and the KV
layout (a page of another model or dtype is never read). Writes go to a temporary name and
are renamed into place, so a reader never sees half a page.

Both directions run on one background thread, off the scheduler thread:
- `write(host_ids, names)` snapshots the host pages at once (the caller may reuse them right
  after) and saves them later;
- `fetch(names, host_ids)` reads pages into host pages in order and stops at the first that
  is missing or unreadable: `handle.num_ok` pages landed, the rest did not (C30: the caller
  keeps only the landed prefix).

Fault seam: `fetch_limit(n) -> pages a fetch of n may read` (None: all), which fault injection
installs (chaos/tier_faults.py).
"""
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
    """One disk -> host fetch; `num_ok` leading pages landed once `done` is set."""

    num_pages: int
    done: threading.Event = field(default_factory=threading.Event)
    num_ok: int = 0
    seconds: float = 0.0


def fingerprint(model_path: str, num_layers: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, page_size: int) -> str:
    """A folder name for one model's pages in one KV layout: the shapes, dtype and page size
    spelled out, plus a hash of the model file or folder's path, size and modification time."""
    st = os.stat(model_path)
    ident = hashlib.sha256(f"{os.path.realpath(model_path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return (f"L{num_layers}-kv{num_kv_heads}x{head_dim}-{str(dtype).removeprefix('torch.')}"
            f"-p{page_size}-{ident.hexdigest()[:16]}")


class DiskKV:
    """Pages of `host` (the host tier's KVCache) saved under `root/fingerprint`."""

    def __init__(self, host: KVCache, root: str, fingerprint_: str):
        self.host = host
        self.dir = os.path.join(root, fingerprint_)
        os.makedirs(self.dir, exist_ok=True)
        self.index: set[str] = {f[:-len(".safetensors")] for f in os.listdir(self.dir)
                                if f.endswith(".safetensors")}
        self.fetch_limit: Callable[[int], int] | None = None   # fault seam (module doc)
        self.num_written = self.num_write_errors = 0
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._worker, name="hicache-disk", daemon=True).start()
        logger.info("disk KV tier at %s: %d pages found", self.dir, len(self.index))

    def has(self, name: str) -> bool:
        """Is the page on disk (ours, or written by another worker since start-up)?"""
        if name in self.index:
            return True
        if os.path.exists(self._path(name)):
            self.index.add(name)
            return True
        return False

    def write(self, host_ids: list[int], names: list[str]) -> None:
        """Save host pages under `names` (skipping those on disk already), in the background."""
        todo = [(h, n) for h, n in zip(host_ids, names) if n not in self.index]
        if not todo:
            return
        pages = self.host.export_pages([h for h, _ in todo])
        for n in (name for _, name in todo):
            self.index.add(n)       # a fetch queued after this write finds it: one thread, FIFO
        self._queue.put(("write", pages, [n for _, n in todo], None))

    def fetch(self, names: list[str], host_ids: list[int]) -> FetchHandle:
        """Read pages `names` into `host_ids`, in the background (see module doc)."""
        handle = FetchHandle(len(names))
        self._queue.put(("fetch", None, list(names), (handle, list(host_ids), time.perf_counter())))
        return handle

    # ---- the worker thread ----------------------------------------------------------------
    def flush(self) -> None:
        """Block until every write and fetch queued so far is done."""
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
                except Exception as exc:   # missing, truncated, or another layout: stop here
                    logger.warning("disk KV tier: page %s unreadable (%s); fetch cut at %d of %d",
                                   name[:12], exc, i, len(names))
                    self.index.discard(name)
                    break
                handle.num_ok = i + 1
        finally:
            handle.seconds = time.perf_counter() - start
            handle.done.set()
