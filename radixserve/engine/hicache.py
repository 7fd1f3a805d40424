"""HostTier: the host-memory tier under the radix cache (--enable-hierarchical-cache): which pages move between device and host, and when.

After SGLang's HiCache; copies are the runner's (runner/host_kv.py); protocol and policies: docs/hicache.md. Each host
page has one owner: the host free list, one node's host_ids, or a disk fetch in flight. A load pins its host pages
before taking device pages (taking may evict); the forward waits per layer for them (KVCache.wait_ready)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from radixserve.engine.radix_cache import PagePool, RadixCache, RadixNode

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2


class LoadHandle(Protocol):
    done: Any              # threading.Event, set when every layer has landed or failed
    failed: bool
    seconds: float
    num_bytes: int

    def wait(self) -> None: ...


class KVTierIO(Protocol):
    num_pages: int
    page_bytes: int

    def backup(self, device_ids: list[int], host_ids: list[int]) -> None: ...

    def load(self, host_ids: list[int], device_ids: list[int]) -> LoadHandle: ...


@dataclass(eq=False)
class Load:
    """One load-back; until `released`, a request whose match reaches its nodes must be checked after its step."""

    handle: LoadHandle
    node: RadixNode              # deepest loaded node; the load locks its path
    host_ids: list[int]
    device_ids: list[int]
    released: bool = False


class HostTier:
    def __init__(self, io: KVTierIO, policy: str, cache: RadixCache):
        if policy not in WRITE_POLICIES:
            raise ValueError(f"unknown --hicache-write-policy {policy!r}; choose from {WRITE_POLICIES}")
        self.io, self.policy, self.cache = io, policy, cache
        self.pool = PagePool(io.num_pages)
        self.pinned: Counter[int] = Counter()      # host page -> loads reading it
        self.loads: list[Load] = []
        self.fail_alloc: Callable[[], bool] | None = None   # fault seam: True refuses one allocation
        self.on_backup: Callable[[RadixNode], None] | None = None
        self.fetching_pages: Callable[[], list[int]] = list
        cache.drop_host = self.pool.free
        self.counters = {"hicache_backups": 0, "hicache_backup_pages": 0, "hicache_backup_bytes": 0,
                         "hicache_loads": 0, "hicache_load_pages": 0, "hicache_load_bytes": 0,
                         "hicache_load_seconds": 0.0, "hicache_failed_loads": 0,
                         "hicache_partial_loads": 0,
                         "hicache_host_evicted_pages": 0, "hicache_host_alloc_failures": 0,
                         "hicache_evictions_skipped_pinned": 0}

    def backup(self, node: RadixNode) -> bool:
        if node.host_ids is not None:
            return True
        assert node.page_ids is not None and not self._loading(node), "backup of unready pages"
        host = self.allocate(len(node.page_ids))
        if host is None:
            return False
        self.io.backup(node.page_ids, host)
        node.host_ids = host
        if self.on_backup is not None:
            self.on_backup(node)
        c = self.counters
        c["hicache_backups"] += 1
        c["hicache_backup_pages"] += len(host)
        c["hicache_backup_bytes"] += len(host) * self.io.page_bytes
        return True

    def on_insert(self, node: RadixNode) -> None:
        if self.policy != "write_through":
            return
        path = []
        while node is not self.cache.root and node.host_ids is None:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            if not self.backup(n):
                return

    def on_match(self, device_path: list[RadixNode]) -> None:
        if self.policy != "write_through_selective":
            return
        for n in device_path:
            if n.host_ids is None and n.hits >= SELECTIVE_HITS and not self._loading(n):
                if not self.backup(n):
                    return

    def demote(self, node: RadixNode) -> bool:
        """Device-eviction hook: True when the node keeps (or now gets) a host copy."""
        if node.host_ids is not None:
            return True
        if self.policy == "write_through_selective" and node.hits < SELECTIVE_HITS:
            return False
        return not self._loading(node) and self.backup(node)

    def allocate(self, n: int) -> list[int] | None:
        if self.fail_alloc is not None and self.fail_alloc():
            self.counters["hicache_host_alloc_failures"] += 1
            return None
        if n > self.pool.num_free:
            self._evict_host(n - self.pool.num_free)
        pages = self.pool.allocate(n)
        if pages is None:
            self.counters["hicache_host_alloc_failures"] += 1
        return pages

    def _evict_host(self, num_pages: int) -> None:
        candidates = []
        for n in self.cache.nodes():
            if n.host_ids is None or any(c.host_ids is not None for c in n.children.values()):
                continue
            if any(self.pinned[p] for p in n.host_ids):
                self.counters["hicache_evictions_skipped_pinned"] += 1
                continue
            candidates.append(n)
        candidates.sort(key=lambda n: (n.page_ids is None, n.last_access_s))
        freed = 0
        for n in candidates:
            if freed >= num_pages:
                break
            freed += len(n.host_ids)
            self.counters["hicache_host_evicted_pages"] += len(n.host_ids)
            if n.page_ids is None:
                self.cache.remove(n)
            else:
                self.pool.free(n.host_ids)
                n.host_ids = None

    def start_load(self, host_path: list[RadixNode], take_device_pages: Callable[[int], list[int] | None],
                   max_pages: int | None = None) -> Load | None:
        """Load a matched host-only path (first `max_pages` pages; split there) to the device; None: no device pages."""
        partial = max_pages is not None and sum(len(n.host_ids) for n in host_path) > max_pages
        if partial:
            host_path = self._head(host_path, max_pages)
            if not host_path:
                return None
        host_ids = [p for n in host_path for p in n.host_ids]
        self.pinned.update(host_ids)
        device = take_device_pages(len(host_ids))
        if device is None:
            self.unpin(host_ids)
            return None
        handle = self.io.load(host_ids, device)
        load = Load(handle, host_path[-1], host_ids, device)
        at = 0
        for n in host_path:
            k = len(n.host_ids)
            n.page_ids, n.loading = device[at:at + k], load
            at += k
        self.cache.num_cached_pages += len(device)
        self.cache.lock(host_path[-1])
        self.loads.append(load)
        c = self.counters
        c["hicache_loads"] += 1
        c["hicache_partial_loads"] += partial
        c["hicache_load_pages"] += len(device)
        c["hicache_load_bytes"] += len(device) * self.io.page_bytes
        return load

    def _head(self, host_path: list[RadixNode], max_pages: int) -> list[RadixNode]:
        head: list[RadixNode] = []
        for n in host_path:
            if max_pages <= 0:
                break
            if len(n.host_ids) > max_pages:
                n = self.cache.split(n, max_pages)
            head.append(n)
            max_pages -= len(n.host_ids)
        return head

    def finish_loads(self, wait: bool = False) -> list[Load]:
        """Release done loads (all, with `wait`); returns the failed ones, host-only again. Every
        request that read a failed load's pages must be discarded first (they hold locks on them)."""
        failed, still = [], []
        for load in self.loads:
            if wait:
                load.handle.wait()
            if not load.handle.done.is_set():
                still.append(load)
                continue
            self.unpin(load.host_ids)
            self.cache.unlock(load.node)
            load.released = True
            self.counters["hicache_load_seconds"] += load.handle.seconds
            if load.handle.failed:
                self.counters["hicache_failed_loads"] += 1
                failed.append(load)
        self.loads = still
        return failed

    def invalidate(self, load: Load) -> list[int]:
        """A failed load's nodes and the device nodes below leave the device; returns the freed pages."""
        freed: list[int] = []
        for top in list(self.cache.nodes()):
            if top.loading is not load or top.page_ids is None:
                continue
            stack = [top]
            while stack:
                n = stack.pop()
                if n.page_ids is None:
                    continue
                assert n.lock_ref == 0, "a failed load's pages are still held"
                if n.host_ids is None:
                    freed.extend(self.cache.remove(n))
                    continue
                freed.extend(n.page_ids)
                self.cache.num_cached_pages -= len(n.page_ids)
                n.page_ids, n.loading = None, None
                stack.extend(n.children.values())
        return freed

    @staticmethod
    def _loading(node: RadixNode) -> bool:
        return node.loading is not None and not node.loading.released

    def unpin(self, host_ids: list[int]) -> None:
        self.pinned.subtract(host_ids)
        for p in host_ids:
            if self.pinned[p] <= 0:
                del self.pinned[p]

    def stats(self) -> dict:
        used = self.io.num_pages - self.pool.num_free
        return {"hicache_host_pages": self.io.num_pages, "hicache_host_used_pages": used,
                "hicache_host_usage": used / self.io.num_pages,
                "hicache_write_policy": self.policy, "hicache_loads_in_flight": len(self.loads),
                **self.counters}

    def check(self) -> None:
        free, tree, fetch = self.pool.free_ids(), self.cache.all_host_ids(), self.fetching_pages()
        owned = free + tree + fetch
        assert len(owned) == len(set(owned)), "a host page has two owners"
        assert len(owned) == self.io.num_pages, (
            f"host free {len(free)} + cached {len(tree)} + fetching {len(fetch)} != {self.io.num_pages}")
        assert set(self.pinned) <= set(tree) | set(fetch), "a pinned host page left the tree"
