"""Approximate multi-tenant prefix tree: which worker was sent which prefix (SGLang router)."""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, NamedTuple, Sequence

Key = str | Sequence[int]


class PrefixMatch(NamedTuple):
    """Longest matched length over all tenants (characters or tokens), and per tenant."""

    matched_len: int
    tenants: dict[str, int]


class _Node:
    __slots__ = ("edge", "children", "parent", "tenants")

    def __init__(self, edge: str | tuple, parent: _Node | None) -> None:
        self.edge = edge  # from the parent; empty only at the root
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, float] = {}  # tenant -> last access (clock seconds)


def _common_len(a: str | tuple, b: str | tuple) -> int:
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ApproxPrefixTree:
    """Radix tree of which worker (tenant) was *sent* which prefix (SGLang router `policies/tree.rs`). A tenant on a
    node is on all its ancestors, whose access times are never older. Size (sum of edge lengths) <= max_size: past it,
    LRU tenant leaves go down to 7/8 of it. Entries idle ttl_s s never match. ValueError: max_size < 1, ttl_s <= 0."""

    def __init__(self, max_size: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._root = _Node("", None)
        self._size = 0
        self._tenant_size: dict[str, int] = {}
        self._last_sweep = clock()

    @property
    def size(self) -> int:
        return self._size

    def tenant_size(self, tenant: str) -> int:
        return self._tenant_size.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._tenant_size)

    def insert(self, key: Key, tenant: str) -> None:
        """Keys are cut to 7/8 of max_size, so the key inserted survives its own eviction."""
        low_water = self.max_size - self.max_size // 8
        key = _normalise(key)[:low_water]
        now = self._clock()
        if now - self._last_sweep >= self.ttl_s / 2:
            self._expire(now)
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = _Node(key[i:], node)
                node.children[key[i]] = child
                self._size += len(child.edge)
            else:
                common = _common_len(child.edge, key[i:])
                if common < len(child.edge):
                    child = self._split(child, common)
            if tenant not in child.tenants:
                self._tenant_size[tenant] = self._tenant_size.get(tenant, 0) + len(child.edge)
            child.tenants[tenant] = now
            node, i = child, i + len(child.edge)
        if self._size > self.max_size:
            self._evict_lru(low_water)

    def match(self, key: Key) -> PrefixMatch:
        """Does not refresh access times: only insert does."""
        key = _normalise(key)
        oldest = self._clock() - self.ttl_s
        matched: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            common = _common_len(child.edge, key[i:])
            live = [t for t, seen in child.tenants.items() if seen >= oldest]
            if not live:
                break
            i += common
            for tenant in live:
                matched[tenant] = i
            if common < len(child.edge):
                break
            node = child
        return PrefixMatch(max(matched.values(), default=0), matched)

    def remove_tenant(self, tenant: str) -> None:
        for node in self._nodes():
            if node.parent is None:
                continue
            if node.tenants.pop(tenant, None) is not None and not node.tenants:
                self._detach(node)
        self._tenant_size.pop(tenant, None)

    def evict(self) -> None:
        self._expire(self._clock())
        if self._size > self.max_size:
            self._evict_lru(self.max_size)

    def _split(self, node: _Node, at: int) -> _Node:
        parent = node.parent
        assert parent is not None and 0 < at < len(node.edge), "bad split"
        upper = _Node(node.edge[:at], parent)
        upper.tenants = dict(node.tenants)
        parent.children[node.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _detach(self, node: _Node) -> None:
        """Unlink a node without tenants (so without children) and its subtree."""
        assert node.parent is not None, "the root is never detached"
        del node.parent.children[node.edge[0]]
        for sub in list(_walk(node)):
            self._size -= len(sub.edge)
            for tenant in sub.tenants:
                self._drop_tenant_len(tenant, len(sub.edge))
            sub.parent = None  # marks it detached for loops over a snapshot of nodes

    def _drop_tenant_len(self, tenant: str, length: int) -> None:
        left = self._tenant_size.get(tenant, 0) - length
        if left > 0:
            self._tenant_size[tenant] = left
        else:
            del self._tenant_size[tenant]

    def _expire(self, now: float) -> None:
        self._last_sweep = now
        oldest = now - self.ttl_s
        for node in self._nodes():
            if node.parent is None:
                continue
            expired = [t for t, seen in node.tenants.items() if seen < oldest]
            for tenant in expired:
                del node.tenants[tenant]
                self._drop_tenant_len(tenant, len(node.edge))
            if expired and not node.tenants:
                self._detach(node)

    def _evict_lru(self, target: int) -> None:
        order = itertools.count()
        heap = [(seen, next(order), tenant, node) for node in self._nodes()
                for tenant, seen in node.tenants.items() if _is_tenant_leaf(node, tenant)]
        heapq.heapify(heap)
        while heap and self._size > target:
            seen, _, tenant, node = heapq.heappop(heap)
            if node.tenants.get(tenant) != seen:
                continue
            del node.tenants[tenant]
            self._drop_tenant_len(tenant, len(node.edge))
            parent = node.parent
            if not node.tenants:
                self._detach(node)
            if parent is not self._root and tenant in parent.tenants \
                    and _is_tenant_leaf(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def _nodes(self) -> list[_Node]:
        return list(_walk(self._root))[1:]


def _walk(top: _Node):
    stack = [top]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _is_tenant_leaf(node: _Node, tenant: str) -> bool:
    return not any(tenant in child.tenants for child in node.children.values())


def _normalise(key: Key) -> str | tuple:
    return key if isinstance(key, str) else tuple(key)
