"""RadixCache: a radix tree over page-aligned token prefixes mapping them to KV page ids.

After RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", 2024). Keys are token-id tuples whose length is a multiple of `page_size`; a node
with key length L holds L / page_size page ids. Children are indexed by their first page of
tokens, so every match and every split lands on a page boundary.

Contract for callers (KVManager is the only one):
- `match` may split nodes; it must run on the scheduler thread only.
- `insert` returns how many leading tokens were already cached; the caller still owns its
  own pages for that overlap and must free those it does not share with the tree.
- A request pins its path with `lock(node)` from admission until it releases its KV; locked
  nodes are never evicted.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(slots=True, eq=False)
class RadixNode:
    key: tuple[int, ...]
    page_ids: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_s: float = 0.0


class MatchResult(NamedTuple):
    page_ids: list[int]   # pages of the matched prefix, in order
    node: RadixNode       # deepest matched node (the root when nothing matched)

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


class InsertResult(NamedTuple):
    num_overlap_tokens: int  # leading tokens that were already in the tree
    page_ids: list[int]      # the tree's pages for the whole inserted key
    node: RadixNode          # node holding the key's last page


class RadixCache:
    """Radix tree of cached KV pages. Page ownership: each page in the tree belongs to it alone."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = RadixNode(key=(), page_ids=[], parent=None, lock_ref=1)
        self.num_cached_pages = 0      # all pages held by the tree
        self.num_locked_pages = 0      # pages on some locked path
        self.num_evicted_pages = 0     # pages given up by evict() since start (cumulative)
        self._clock = itertools.count()

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_evictable_pages(self) -> int:
        return self.num_cached_pages - self.num_locked_pages

    def _aligned(self, token_ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        n = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:n])

    def _common_pages(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Number of whole leading pages a and b share."""
        p = self.page_size
        n = min(len(a), len(b)) // p
        i = 0
        while i < n and a[i * p:(i + 1) * p] == b[i * p:(i + 1) * p]:
            i += 1
        return i

    def match_len(self, token_ids: list[int]) -> int:
        """Cached prefix length in tokens, without touching the tree (for scheduling policies)."""
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

    # ---- match / insert / evict -------------------------------------------------------------
    def match(self, token_ids: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of token_ids; splits a node on a partial match."""
        key, node, pages = self._aligned(token_ids), self.root, []
        now = self._now()
        while len(pages) * self.page_size < len(key):
            rest = key[len(pages) * self.page_size:]
            child = node.children.get(rest[:self.page_size])
            if child is None:
                break
            k = self._common_pages(child.key, rest)
            if k * self.page_size < len(child.key):
                child = self._split(child, k)
            child.last_access_s = now
            pages.extend(child.page_ids)
            node = child
        return MatchResult(pages, node)

    def insert(self, token_ids: list[int], page_ids: list[int]) -> InsertResult:
        """Insert a page-aligned key (len == len(page_ids) * page_size) with its pages.

        Pages of the overlap already in the tree are kept; the new remainder becomes one leaf
        owned by the tree. Returns the overlap so the caller frees its duplicate pages.
        """
        key = tuple(token_ids)
        assert len(key) == len(page_ids) * self.page_size, "insert key must be page-aligned"
        match = self.match(key)
        node, n = match.node, match.num_pages
        if n < len(page_ids):
            leaf = RadixNode(key=key[n * self.page_size:], page_ids=list(page_ids[n:]),
                             parent=node, last_access_s=self._now())
            node.children[leaf.key[:self.page_size]] = leaf
            self.num_cached_pages += len(leaf.page_ids)
            node = leaf
        return InsertResult(n * self.page_size, match.page_ids + list(page_ids[n:]), node)

    def evict(self, num_pages: int) -> list[int]:
        """Remove least-recently-used unlocked leaves until num_pages pages are freed or none
        are left to evict. Returns the freed page ids (the caller gives them to the pool)."""
        heap = [(n.last_access_s, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.page_ids)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            self.num_cached_pages -= len(leaf.page_ids)
            self.num_evicted_pages += len(leaf.page_ids)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_s, id(parent), parent))
        return freed

    def reset(self) -> list[int]:
        """Drop every node (only valid when nothing is locked). Returns all freed pages."""
        assert self.num_locked_pages == 0, "cannot reset a radix cache with locked pages"
        pages = [p for n in self._nodes() for p in n.page_ids]
        self.root.children.clear()
        self.num_cached_pages = 0
        return pages

    # ---- locking ----------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Pin node and its ancestors against eviction (reference counted)."""
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

    # ---- internals --------------------------------------------------------------------------
    def _split(self, child: RadixNode, num_pages: int) -> RadixNode:
        """Split child after num_pages pages; returns the new upper node (same lock count)."""
        cut = num_pages * self.page_size
        upper = RadixNode(key=child.key[:cut], page_ids=child.page_ids[:num_pages],
                          parent=child.parent, lock_ref=child.lock_ref,
                          last_access_s=child.last_access_s)
        child.parent.children[upper.key[:self.page_size]] = upper
        child.key, child.page_ids, child.parent = child.key[cut:], child.page_ids[num_pages:], upper
        upper.children[child.key[:self.page_size]] = child
        return upper

    def _now(self) -> float:
        # Monotonic time plus a tie-breaking counter, so LRU order is total even within a tick.
        return time.monotonic() + next(self._clock) * 1e-9

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)

    def all_page_ids(self) -> list[int]:
        """Every page the tree holds (for invariant checks)."""
        return [p for n in self._nodes() for p in n.page_ids]

    def check(self) -> None:
        """Assert structural invariants: aligned keys, page counts, lock counts."""
        cached = locked = 0
        for n in self._nodes():
            assert n.key and len(n.key) == len(n.page_ids) * self.page_size, "misaligned node"
            assert n.parent.children.get(n.key[:self.page_size]) is n, "broken parent link"
            assert n.lock_ref >= 0
            if n.parent is not self.root:
                assert n.parent.lock_ref >= n.lock_ref, "child locked more than its parent"
            cached += len(n.page_ids)
            locked += len(n.page_ids) if n.lock_ref > 0 else 0
        assert cached == self.num_cached_pages, f"cached pages {cached} != {self.num_cached_pages}"
        assert locked == self.num_locked_pages, f"locked pages {locked} != {self.num_locked_pages}"
