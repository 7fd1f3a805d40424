"""PagePool (free KV page ids) and RadixCache (SGLang's RadixAttention): page-aligned token prefixes -> KV page ids.

Children are keyed by their first page of tokens. KVManager alone calls it (scheduler thread): `match` may split nodes,
the caller frees its own pages of an `insert`'s overlap, locked paths are never evicted. Tiers (docs/hicache.md): device
nodes form a subtree at the root; a match is device, then host-only nodes."""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple


class PagePool:
    """Free page ids in [0, num_pages); running out returns None, never raises. Owners of used pages
    track them (KVManager.check_invariants). With `num_fp8_pages` (--kv-history-dtype auto) two free lists:
    [0, num_model_pages) model-dtype pages (prompts; the tree's), the rest FP8 pages (decodes; else a model page)."""

    def __init__(self, num_pages: int, num_fp8_pages: int = 0):
        if num_pages < 1 or not 0 <= num_fp8_pages < num_pages:
            raise ValueError(f"num_pages must be >= 1 and num_fp8_pages in [0, num_pages), got "
                             f"{num_pages}, {num_fp8_pages}")
        self.num_pages, self.num_fp8_pages = num_pages, num_fp8_pages
        self.num_model_pages = num_pages - num_fp8_pages
        self._free: deque[int] = deque(range(self.num_model_pages))
        self._free_fp8: deque[int] = deque(range(self.num_model_pages, num_pages))
        self.on_free: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_fp8)

    @property
    def num_free_fp8(self) -> int:
        return len(self._free_fp8)

    def num_free_for(self, fp8: bool) -> int:
        """Free pages an allocate(n, fp8) may take."""
        return self.num_free if fp8 else len(self._free)

    def allocate(self, n: int, fp8: bool = False) -> list[int] | None:
        """n page ids; `fp8`: FP8 pages first, then model-dtype ones."""
        if n > self.num_free_for(fp8):
            return None
        from_fp8 = min(n, len(self._free_fp8)) if fp8 else 0
        return [self._free_fp8.popleft() for _ in range(from_fp8)] + [self._free.popleft() for _ in range(n - from_fp8)]

    def free(self, page_ids: list[int]) -> None:
        for p in page_ids:
            assert 0 <= p < self.num_pages, f"page id {p} out of range"
            (self._free if p < self.num_model_pages else self._free_fp8).append(p)
        if self.on_free is not None:
            self.on_free(page_ids)

    def free_ids(self) -> list[int]:
        return list(self._free) + list(self._free_fp8)

    def num_model_prefix(self, page_ids: list[int]) -> int:
        """How many of `page_ids` lead before the first FP8 page."""
        return next((i for i, p in enumerate(page_ids) if p >= self.num_model_pages), len(page_ids))


@dataclass(slots=True, eq=False)
class RadixNode:
    key: tuple[int, ...]
    page_ids: list[int] | None          # None when only the host tier holds them
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_s: float = 0.0
    host_ids: list[int] | None = None
    hits: int = 0
    loading: Any = None


class MatchResult(NamedTuple):
    page_ids: list[int]
    node: RadixNode       # deepest matched device node (the root when nothing matched)
    host_path: list[RadixNode] = []   # host-only nodes matched past `node`, in order
    device_path: list[RadixNode] = []

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


class InsertResult(NamedTuple):
    num_overlap_tokens: int
    page_ids: list[int]
    node: RadixNode


class RadixCache:
    def __init__(self, page_size: int, drop_host: Callable[[list[int]], None] | None = None):
        self.page_size = page_size
        self.drop_host = drop_host
        self.root = RadixNode(key=(), page_ids=[], parent=None, lock_ref=1)
        self.num_cached_pages = 0
        self.num_locked_pages = 0
        self.num_evicted_pages = 0
        self._clock = itertools.count()

    @property
    def num_evictable_pages(self) -> int:
        return self.num_cached_pages - self.num_locked_pages

    def _aligned(self, token_ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        n = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:n])

    def _common_pages(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        p = self.page_size
        n = min(len(a), len(b)) // p
        i = 0
        while i < n and a[i * p:(i + 1) * p] == b[i * p:(i + 1) * p]:
            i += 1
        return i

    def match_len(self, token_ids: list[int]) -> int:
        key, node, matched = self._aligned(token_ids), self.root, 0
        while matched < len(key):
            child = node.children.get(key[matched:matched + self.page_size])
            if child is None:
                break
            k = self._common_pages(child.key, key[matched:])
            matched += k * self.page_size
            if k * self.page_size < len(child.key):
                break
            node = child
        return matched

    def match(self, token_ids: list[int]) -> MatchResult:
        key, node, pages = self._aligned(token_ids), self.root, []
        host_path: list[RadixNode] = []
        device_path: list[RadixNode] = []
        now, matched, walk = self._now(), 0, self.root
        while matched < len(key):
            rest = key[matched:]
            child = walk.children.get(rest[:self.page_size])
            if child is None:
                break
            k = self._common_pages(child.key, rest)
            if k * self.page_size < len(child.key):
                child = self.split(child, k)
            child.last_access_s = now
            if child.page_ids is None or host_path:
                host_path.append(child)
            else:
                pages.extend(child.page_ids)
                device_path.append(child)
                node = child
            matched += len(child.key)
            walk = child
        return MatchResult(pages, node, host_path, device_path)

    def insert(self, token_ids: list[int], page_ids: list[int]) -> InsertResult:
        """Insert a key of len(page_ids) * page_size tokens; the tree keeps its own overlap pages."""
        key = tuple(token_ids)
        assert len(key) == len(page_ids) * self.page_size, "insert key must be page-aligned"
        match = self.match(key)
        node, n = match.node, match.num_pages
        for host in match.host_path:   # host-only nodes the caller recomputed: adopt its pages
            k = len(host.key) // self.page_size
            host.page_ids = list(page_ids[n:n + k])
            self.num_cached_pages += k
            node, n = host, n + k
        if n < len(page_ids):
            leaf = RadixNode(key=key[n * self.page_size:], page_ids=list(page_ids[n:]),
                             parent=node, last_access_s=self._now())
            node.children[leaf.key[:self.page_size]] = leaf
            self.num_cached_pages += len(leaf.page_ids)
            node = leaf
        tree_pages = match.page_ids + list(page_ids[len(match.page_ids):])
        return InsertResult(n * self.page_size, tree_pages, node)

    def insert_host(self, token_ids: tuple[int, ...], host_ids: list[int]) -> list[int]:
        """Host-only pages for a key's last len(host_ids) pages (a disk fetch); returns the unused
        host ids (already held, or the key's head is gone) for the caller to free."""
        match = self.match(token_ids)
        have = match.num_pages + sum(len(h.host_ids) for h in match.host_path)
        start = len(token_ids) // self.page_size - len(host_ids)
        if have < start:
            return list(host_ids)
        parent = match.host_path[-1] if match.host_path else match.node
        rest = host_ids[have - start:]
        if rest:
            leaf = RadixNode(key=tuple(token_ids[have * self.page_size:]), page_ids=None,
                             parent=parent, last_access_s=self._now(), host_ids=list(rest))
            parent.children[leaf.key[:self.page_size]] = leaf
        return list(host_ids[:have - start])

    def evict(self, num_pages: int, demote: Callable[[RadixNode], bool] | None = None) -> list[int]:
        """Frees <= num_pages device pages of LRU unlocked leaves; ones with a host copy (or demoted) stay host-only."""
        heap = [(n.last_access_s, id(n), n) for n in self._nodes()
                if n.lock_ref == 0 and self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.page_ids)
            self.num_cached_pages -= len(leaf.page_ids)
            self.num_evicted_pages += len(leaf.page_ids)
            if leaf.host_ids is not None or (demote is not None and demote(leaf)):
                leaf.page_ids, leaf.loading = None, None
            else:
                leaf.page_ids = None
                self.remove(leaf)
            parent = leaf.parent
            if parent is not self.root and parent.lock_ref == 0 and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_s, id(parent), parent))
        return freed

    def remove(self, node: RadixNode) -> list[int]:
        del node.parent.children[node.key[:self.page_size]]
        device: list[int] = []
        host: list[int] = []
        for n in [node, *self._nodes(node)]:
            assert n.lock_ref == 0, "removing a locked radix node"
            device.extend(n.page_ids or ())
            host.extend(n.host_ids or ())
            n.host_ids = None
        self.num_cached_pages -= len(device)
        if host:
            assert self.drop_host is not None, "host pages in a tree without a host tier"
            self.drop_host(host)
        return device

    def reset(self) -> list[int]:
        assert self.num_locked_pages == 0, "cannot reset a radix cache with locked pages"
        pages: list[int] = []
        for child in list(self.root.children.values()):
            pages.extend(self.remove(child))
        return pages

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.page_ids)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked radix node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.page_ids)
            node = node.parent

    def split(self, child: RadixNode, num_pages: int) -> RadixNode:
        """Split child after num_pages pages (0 < num_pages < its pages); returns the new upper node."""
        cut = num_pages * self.page_size

        def halves(ids: list[int] | None) -> tuple[list[int] | None, list[int] | None]:
            return (None, None) if ids is None else (ids[:num_pages], ids[num_pages:])

        (up_dev, low_dev), (up_host, low_host) = halves(child.page_ids), halves(child.host_ids)
        upper = RadixNode(key=child.key[:cut], page_ids=up_dev, parent=child.parent,
                          lock_ref=child.lock_ref, last_access_s=child.last_access_s,
                          host_ids=up_host, hits=child.hits, loading=child.loading)
        child.parent.children[upper.key[:self.page_size]] = upper
        child.key, child.page_ids, child.host_ids = child.key[cut:], low_dev, low_host
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        return upper

    def _now(self) -> float:
        # The counter makes LRU order total within a clock tick.
        return time.monotonic() + next(self._clock) * 1e-9

    def _nodes(self, top: RadixNode | None = None):
        stack = list((top or self.root).children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _is_device_leaf(node: RadixNode) -> bool:
        return node.page_ids is not None and all(c.page_ids is None for c in node.children.values())

    def nodes(self):
        return self._nodes()

    def all_page_ids(self) -> list[int]:
        return [p for n in self._nodes() for p in n.page_ids or ()]

    def all_host_ids(self) -> list[int]:
        return [p for n in self._nodes() for p in n.host_ids or ()]

    def check(self) -> None:
        cached = locked = 0
        for n in self._nodes():
            assert n.page_ids is not None or n.host_ids is not None, "a node in no tier"
            for ids in (n.page_ids, n.host_ids):
                assert ids is None or (n.key and len(n.key) == len(ids) * self.page_size), "misaligned node"
            assert n.parent.children.get(n.key[:self.page_size]) is n, "broken parent link"
            assert n.lock_ref >= 0
            if n.parent is not self.root:
                assert n.parent.lock_ref >= n.lock_ref, "child locked more than its parent"
                assert n.page_ids is None or n.parent.page_ids is not None, "device node under a host-only one"
            assert n.lock_ref == 0 or n.page_ids is not None, "locked node off the device"
            cached += len(n.page_ids or ())
            locked += len(n.page_ids or ()) if n.lock_ref > 0 else 0
        assert cached == self.num_cached_pages, f"cached pages {cached} != {self.num_cached_pages}"
        assert locked == self.num_locked_pages, f"locked pages {locked} != {self.num_locked_pages}"
