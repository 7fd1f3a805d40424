"""Approximate multi-tenant prefix tree: which worker was sent which prefix (SGLang router)."""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, NamedTuple, Sequence

Key = str | Sequence[int]


class PrefixMatch(NamedTuple):
    """Result of ApproxPrefixTree.match: the longest matched length over all tenants
    (characters or tokens) and each tenant's own matched length."""

    matched_len: int
    tenants: dict[str, int]


class _Node:
    __slots__ = ("edge", "children", "parent", "tenants")

    def __init__(self, edge: str | tuple, parent: _Node | None) -> None:
        self.edge = edge  # the compressed edge from the parent, never empty except at the root
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, float] = {}  # tenant -> last access (clock seconds)


def _common_len(a: str | tuple, b: str | tuple) -> int:
    """Length of the common prefix of a and b, by binary search over C-level slice compares."""
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
    """Radix tree (compressed edges) over str or list[int] keys; tenant = worker URL.

    Built from the router's own routing history, so it is approximate: it says which worker
    was *sent* a prefix recently, not what that worker still caches (SGLang router
    `policies/tree.rs`). Every node records tenant -> last access; a tenant present on a node
    is present on all its ancestors, and an ancestor's access time is never older.

    Size is the sum of edge lengths (characters or tokens), i.e. what the tree holds.
    `insert` keeps it at or below `max_size`: past it, least-recently-used tenant leaves are
    dropped across all tenants down to 7/8 of `max_size` (so the cost is amortised; SGLang
    runs the same eviction from a background thread). Keys are cut to that 7/8 so the key
    just inserted always survives its own eviction. Entries unused for `ttl_s` seconds no
    longer match and are dropped by the periodic sweep in `insert` or by `evict()`.
    `clock` returns seconds (monotonic); inject a fake one in tests.

    Raises ValueError on max_size < 1 or ttl_s <= 0.
    """

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
        """Keys held in all (characters or tokens): the sum of edge lengths."""
        return self._size

    def tenant_size(self, tenant: str) -> int:
        """Keys on the paths recorded for `tenant` (0 if unknown)."""
        return self._tenant_size.get(tenant, 0)

    def tenants(self) -> list[str]:
        """Tenants that hold at least one entry."""
        return list(self._tenant_size)

    def insert(self, key: Key, tenant: str) -> None:
        """Record that `key` was sent to `tenant` (refreshes access times along its path).
        Keys are cut to 7/8 of max_size. Evicts as described above."""
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
        """Longest prefix of `key` recorded for each tenant (entries past ttl_s ignored).
        Does not refresh access times: only insert does."""
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
        """Forget every entry of `tenant` (a removed worker)."""
        for node in self._nodes():
            if node.parent is None:
                continue  # inside a subtree detached earlier in this loop
            if node.tenants.pop(tenant, None) is not None and not node.tenants:
                self._detach(node)
        self._tenant_size.pop(tenant, None)

    def evict(self) -> None:
        """Drop entries unused for ttl_s, then LRU tenant leaves until size <= max_size."""
        self._expire(self._clock())
        if self._size > self.max_size:
            self._evict_lru(self.max_size)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge at `at`; return the new upper node (same tenants and times)."""
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
        """Unlink a node that holds no tenant (nor, then, any child) and its subtree."""
        assert node.parent is not None, "the root is never detached"
        del node.parent.children[node.edge[0]]
        for sub in list(_walk(node)):
            self._size -= len(sub.edge)
            for tenant in sub.tenants:  # entries of the same tenants, older: drop them too
                self._drop_tenant_len(tenant, len(sub.edge))
            sub.parent = None  # marks it detached for loops over a snapshot of nodes

    def _drop_tenant_len(self, tenant: str, length: int) -> None:
        left = self._tenant_size.get(tenant, 0) - length
        if left > 0:
            self._tenant_size[tenant] = left
        else:
            del self._tenant_size[tenant]

    def _expire(self, now: float) -> None:
        """Drop every (tenant, node) entry older than ttl_s; detach emptied nodes."""
        self._last_sweep = now
        oldest = now - self.ttl_s
        for node in self._nodes():
            if node.parent is None:
                continue  # inside a subtree detached earlier in this sweep
            expired = [t for t, seen in node.tenants.items() if seen < oldest]
            for tenant in expired:
                del node.tenants[tenant]
                self._drop_tenant_len(tenant, len(node.edge))
            if expired and not node.tenants:
                self._detach(node)

    def _evict_lru(self, target: int) -> None:
        """Remove least-recently-used tenant leaves (across tenants) until size <= target."""
        order = itertools.count()  # tie-break so nodes are never compared
        heap = [(seen, next(order), tenant, node) for node in self._nodes()
                for tenant, seen in node.tenants.items() if _is_tenant_leaf(node, tenant)]
        heapq.heapify(heap)
        while heap and self._size > target:
            seen, _, tenant, node = heapq.heappop(heap)
            if node.tenants.get(tenant) != seen:
                continue  # already gone
            del node.tenants[tenant]
            self._drop_tenant_len(tenant, len(node.edge))
            parent = node.parent
            if not node.tenants:
                self._detach(node)
            if parent is not self._root and tenant in parent.tenants \
                    and _is_tenant_leaf(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def _nodes(self) -> list[_Node]:
        """Every node but the root, parents before children (a snapshot list)."""
        return list(_walk(self._root))[1:]


def _walk(top: _Node):
    """Yield `top` and its subtree, parents before children, without recursion."""
    stack = [top]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _is_tenant_leaf(node: _Node, tenant: str) -> bool:
    return not any(tenant in child.tenants for child in node.children.values())


def _normalise(key: Key) -> str | tuple:
    return key if isinstance(key, str) else tuple(key)
