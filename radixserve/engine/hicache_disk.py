"""DiskTier: the disk tier's books (--hicache-storage-dir): page names, what to save, and fetches that bring pages back to host while their request waits in WAITING_FOR_KV.

Copies are the runner's (runner/disk_kv.py); protocol: docs/hicache.md. Every page that gets a host copy is saved; a
fetch's landed pages (a leading run) join the tree as host-only nodes and its request returns to the queue head."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.engine.hicache import HostTier
from radixserve.engine.radix_cache import RadixNode

MIN_FETCH_PAGES = 2      # a shorter disk hit is recomputed: not worth a round trip


class DiskIO(Protocol):
    index: set[str]

    def has(self, name: str) -> bool: ...

    def write(self, host_ids: list[int], names: list[str]) -> None: ...

    def fetch(self, names: list[str], host_ids: list[int]) -> Any: ...


def page_names(token_ids: list[int] | tuple[int, ...], page_size: int, start_page: int = 0) -> list[str]:
    """Full pages' names from `start_page`: name_i = sha256(name_{i-1} + page i's tokens, int32 LE), name_{-1} = ''."""
    names, prev = [], b""
    for i in range(len(token_ids) // page_size):
        page = token_ids[i * page_size:(i + 1) * page_size]
        digest = hashlib.sha256(prev + b"".join(t.to_bytes(4, "little", signed=True) for t in page))
        prev = digest.digest()
        if i >= start_page:
            names.append(digest.hexdigest())
    return names


@dataclass(eq=False)
class Fetch:
    handle: Any
    key: tuple[int, ...]
    host_ids: list[int]
    waiters: list = field(default_factory=list)


class DiskTier:
    def __init__(self, io: DiskIO, host: HostTier, page_size: int):
        self.io, self.host, self.page_size = io, host, page_size
        self.fetches: list[Fetch] = []
        host.on_backup = self.save
        host.fetching_pages = lambda: [p for f in self.fetches for p in f.host_ids]
        self.counters = {"hicache_disk_fetches": 0, "hicache_disk_fetch_pages": 0,
                         "hicache_disk_fetch_seconds": 0.0, "hicache_disk_failed_pages": 0,
                         "hicache_disk_saved_pages": 0}

    def save(self, node: RadixNode) -> None:
        tokens: list[tuple[int, ...]] = []
        n = node
        while n.parent is not None:
            tokens.append(n.key)
            n = n.parent
        prefix = [t for key in reversed(tokens) for t in key]
        first = len(prefix) // self.page_size - len(node.host_ids)
        names = page_names(prefix, self.page_size, first)
        new = sum(name not in self.io.index for name in names)
        self.io.write(node.host_ids, names)
        self.counters["hicache_disk_saved_pages"] += new

    def start(self, req: Any, prefix: list[int], num_matched_pages: int) -> Fetch | None:
        """Fetch the disk pages of `prefix` past its first `num_matched_pages` for `req`; None when fewer
        than MIN_FETCH_PAGES are on disk or no host pages can be had."""
        names = page_names(prefix, self.page_size, num_matched_pages)
        n = 0
        while n < len(names) and self.io.has(names[n]):
            n += 1
        if n < MIN_FETCH_PAGES:
            return None
        end = (num_matched_pages + n) * self.page_size
        for f in self.fetches:          # another request is fetching this prefix already
            if f.key[:end] == tuple(prefix[:end]) and len(f.key) >= end:
                f.waiters.append(req)
                return f
        host_ids = self.host.allocate(n)
        if host_ids is None:
            return None
        self.host.pinned.update(host_ids)
        fetch = Fetch(self.io.fetch(names[:n], host_ids), tuple(prefix[:end]), host_ids, [req])
        self.fetches.append(fetch)
        self.counters["hicache_disk_fetches"] += 1
        return fetch

    def poll(self) -> list[Fetch]:
        done = [f for f in self.fetches if f.handle.done.is_set()]
        self.fetches = [f for f in self.fetches if not f.handle.done.is_set()]
        for f in done:
            self.host.unpin(f.host_ids)
            ok = f.handle.num_ok
            self.counters["hicache_disk_fetch_pages"] += ok
            self.counters["hicache_disk_failed_pages"] += len(f.host_ids) - ok
            self.counters["hicache_disk_fetch_seconds"] += f.handle.seconds
            self.host.pool.free(f.host_ids[ok:])
            if ok:
                key = f.key[:len(f.key) - (len(f.host_ids) - ok) * self.page_size]
                self.host.pool.free(self.host.cache.insert_host(key, f.host_ids[:ok]))
        return done

    def stats(self) -> dict:
        return {"hicache_disk_pages": len(self.io.index), "hicache_disk_fetches_in_flight": len(self.fetches),
                **self.counters}
