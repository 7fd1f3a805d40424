"""HostTier: the host-memory tier under the radix cache (--enable-hierarchical-cache); which pages move between device and host, and when.

After SGLang's HiCache. The copies themselves are the runner's
(runner/host_kv.py, the KVTierIO protocol below); this module keeps the books:

- **Ownership.** Every host page has exactly one owner: the host free list or one radix node
  (`node.host_ids`). `check` verifies it, as KVManager does for device pages.
- **Write policies.** write_through: a node is copied to host when its pages enter the tree;
  write_through_selective: when a match reaches it for the second time (SGLang's threshold);
  write_back: when the device evicts it. A node the device evicts without a host copy (its
  write-through copy failed or was reclaimed) gets one then, except under selective for nodes
  below the threshold. A copy that fails (host pool exhausted, every host page pinned, or the
  hicache.host_alloc fault) leaves the node without one: device eviction then drops it, as
  without the tier (C31).
- **Host eviction** takes host leaves (host copies with no host copy below them) whose pages
  no load is reading: first redundant copies of nodes still on the device (least recently
  used first: they cost nothing to drop), then host-only nodes, which leave the tree. So a
  host pool smaller than the device pool still keeps what the device evicted (C31).
- **Load-back** (`start_load`): the host pages are pinned *before* device pages are allocated
  for them (an allocation may evict, and eviction must not recycle what the load reads:
  C29); the nodes get their device pages at once (so a match in the same step shares the
  load) and are locked by the load until it is done. The forward pass reads them through
  KVCache's per-layer readiness wait. `finish_loads` releases finished loads; a failed one
  returns its nodes to host-only and reports it, so the engine recomputes every request that
  read the pages (C30): never served as a hit.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from radixserve.engine.page_pool import PagePool
from radixserve.engine.radix_cache import RadixCache, RadixNode

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2      # write_through_selective copies a node on its second hit


class LoadHandle(Protocol):
    done: Any              # threading.Event, set when every layer has landed or failed
    failed: bool
    seconds: float
    num_bytes: int

    def wait(self) -> None: ...


class KVTierIO(Protocol):
    """What the runner provides for the host tier (runner/host_kv.py)."""

    num_pages: int          # host pages
    page_bytes: int         # bytes one page occupies (K + V, every layer)

    def backup(self, device_ids: list[int], host_ids: list[int]) -> None: ...

    def load(self, host_ids: list[int], device_ids: list[int]) -> LoadHandle: ...


@dataclass(eq=False)
class Load:
    """One load-back in the books: until `released` (finish_loads), every request whose match
    reaches its nodes (`node.loading`) is a reader that must be checked after its step."""

    handle: LoadHandle
    node: RadixNode              # deepest loaded node; the load holds a lock on its path
    host_ids: list[int]
    device_ids: list[int]
    released: bool = False


class HostTier:
    """Host pages of the radix tree `cache` (see module doc). Scheduler thread only."""

    def __init__(self, io: KVTierIO, policy: str, cache: RadixCache):
        if policy not in WRITE_POLICIES:
            raise ValueError(f"unknown --hicache-write-policy {policy!r}; choose from {WRITE_POLICIES}")
        self.io, self.policy, self.cache = io, policy, cache
        self.pool = PagePool(io.num_pages)
        self.pinned: Counter[int] = Counter()      # host page -> loads reading it
        self.loads: list[Load] = []
        self.fail_alloc: Callable[[], bool] | None = None   # fault seam: True refuses one allocation
        self.on_backup: Callable[[RadixNode], None] | None = None   # the disk tier's save
        self.fetching_pages: Callable[[], list[int]] = list   # host pages disk fetches fill
        cache.drop_host = self.pool.free
        self.counters = {"hicache_backups": 0, "hicache_backup_pages": 0, "hicache_backup_bytes": 0,
                         "hicache_loads": 0, "hicache_load_pages": 0, "hicache_load_bytes": 0,
                         "hicache_load_seconds": 0.0, "hicache_failed_loads": 0,
                         "hicache_partial_loads": 0,
                         "hicache_host_evicted_pages": 0, "hicache_host_alloc_failures": 0,
                         "hicache_evictions_skipped_pinned": 0}

    # ---- device -> host ----------------------------------------------------------------------
    def backup(self, node: RadixNode) -> bool:
        """Give a device node a host copy now (no-op when it has one). False when no host
        pages could be had."""
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
        """write_through: copy the path's new pages (those without a host copy) up to `node`."""
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
        """write_through_selective: copy matched device nodes that reached the hit threshold."""
        if self.policy != "write_through_selective":
            return
        for n in device_path:
            if n.host_ids is None and n.hits >= SELECTIVE_HITS and not self._loading(n):
                if not self.backup(n):
                    return

    def demote(self, node: RadixNode) -> bool:
        """Eviction hook (device pages still in place): True when the node keeps a host copy,
        making one now where the policy allows (see module doc)."""
        if node.host_ids is not None:
            return True
        if self.policy == "write_through_selective" and node.hits < SELECTIVE_HITS:
            return False
        return not self._loading(node) and self.backup(node)

    def allocate(self, n: int) -> list[int] | None:
        """n free host pages (evicting host leaves no load reads), or None."""
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
        """Free host pages of least-recently-used host leaves no load is reading."""
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
                self.cache.remove(n)          # its host pages come back through drop_host
            else:
                self.pool.free(n.host_ids)
                n.host_ids = None

    # ---- host -> device ----------------------------------------------------------------------
    def start_load(self, host_path: list[RadixNode], take_device_pages: Callable[[int], list[int] | None],
                   max_pages: int | None = None) -> Load | None:
        """Load host-only nodes (a matched path, in order) back to the device; None when the
        device pages cannot be had. With `max_pages`, only the path's first `max_pages` pages
        load (the node they end in is split there; the rest stays host-only for a later
        match). See the module doc for the order of the steps."""
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
        """The longest head of host_path with at most max_pages pages, splitting the node
        that crosses the bound."""
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
        """Release loads that are done (all of them, waiting, with `wait`); returns the failed
        ones, whose nodes are host-only again. The engine must first have discarded every
        request that read a failed load's pages (they hold locks on them)."""
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
        """A failed load's nodes, and every device node below them (another load of the same
        step may have brought their children), leave the device: host-only again where they
        have a host copy, removed where not. Returns the freed device pages (for the pool).
        Every request that read them must have released them first."""
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

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        used = self.io.num_pages - self.pool.num_free
        return {"hicache_host_pages": self.io.num_pages, "hicache_host_used_pages": used,
                "hicache_host_usage": used / self.io.num_pages,
                "hicache_write_policy": self.policy, "hicache_loads_in_flight": len(self.loads),
                **self.counters}

    def check(self) -> None:
        """Assert host-page ownership: free + tree + disk fetches in flight == total, no page
        twice, pins only on tree or fetch pages."""
        free, tree, fetch = self.pool.free_ids(), self.cache.all_host_ids(), self.fetching_pages()
        owned = free + tree + fetch
        assert len(owned) == len(set(owned)), "a host page has two owners"
        assert len(owned) == self.io.num_pages, (
            f"host free {len(free)} + cached {len(tree)} + fetching {len(fetch)} != {self.io.num_pages}")
        assert set(self.pinned) <= set(tree) | set(fetch), "a pinned host page left the tree"
