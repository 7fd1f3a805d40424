"""KVManager: the one façade the scheduler uses for KV pages: match, allocate, commit, free."""
from __future__ import annotations

from radixserve.engine.hicache import HostTier, KVTierIO
from radixserve.engine.hicache_disk import DiskTier
from radixserve.engine.radix_cache import PagePool, RadixCache
from radixserve.engine.request import Request


def paired_key(token_ids: list[int]) -> list[int]:
    """Radix keys of an EAGLE draft's KV: position i's draft KV is computed from x_i's hidden state and x_{i+1},
    so its key is the pair (x_i, x_{i+1}) (as SGLang's EAGLE bigram keys): len(token_ids) - 1 keys."""
    return [a << 32 | b for a, b in zip(token_ids, token_ids[1:])]


class KVManager:
    """Each page has one owner (check_invariants): the free list, the radix tree, or a request's private tail
    page_ids[num_tree_pages:]. `host_io`: hicache.py's host tier. `paired_keys`: pages also hold EAGLE draft KV
    (runner/mtp.py), keyed by paired_key; a page joins the tree once its next token and draft KV exist. `num_fp8_pages`
    (--kv-history-dtype auto): decode steps take FP8 pages; the tree gets a request's pages before its first FP8 one."""

    def __init__(self, num_pages: int, page_size: int, enable_cache: bool = True,
                 host_io: KVTierIO | None = None, write_policy: str = "write_through",
                 paired_keys: bool = False, num_fp8_pages: int = 0):
        assert not (paired_keys and getattr(host_io, "disk", None)), "the disk tier hashes token keys"
        self.page_size = page_size
        self.paired_keys = paired_keys
        self.pool = PagePool(num_pages, num_fp8_pages)
        self.cache = RadixCache(page_size)
        self.enable_cache = enable_cache
        self.tier = HostTier(host_io, write_policy, self.cache) if host_io and enable_cache else None
        disk_io = getattr(host_io, "disk", None)
        self.disk = DiskTier(disk_io, self.tier, page_size) if self.tier and disk_io else None

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_model_pages(self) -> int:
        """Pages a prompt may use: a request longer than these could never be (re)computed."""
        return self.pool.num_model_pages

    @property
    def num_available_pages(self) -> int:
        return self.pool.num_free + self.cache.num_evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_len(self, req: Request) -> int:
        if not self._may_match(req):
            return 0
        return self.cache.match_len(self._key(req.all_ids[:req.num_tokens - 1]))

    def match(self, req: Request, keep_free_pages: int = 0) -> int:
        """Attach and lock the longest cached prefix of req's first num_tokens - 1 tokens (whole pages);
        host pages past it start loading, leaving `keep_free_pages` available. Returns matched tokens."""
        assert not req.page_ids and req.last_node is None, "match on a request holding pages"
        if not self._may_match(req):
            return 0
        result = self.cache.match(self._key(req.all_ids[:req.num_tokens - 1]))
        self.cache.lock(result.node)
        req.page_ids = list(result.page_ids)
        req.num_tree_pages = len(result.page_ids)
        req.last_node = result.node
        req.loads = [n.loading for n in result.device_path
                     if n.loading is not None and not n.loading.released]
        req.num_host_hit_tokens = 0
        for node in result.device_path:
            node.hits += 1
        if self.tier is not None:
            if result.host_path and not req.skip_host_tier:
                self._load_back(req, result.host_path, keep_free_pages)
            self.tier.on_match(result.device_path)
        if self.disk is not None and not req.skip_host_tier and not req.skip_disk:
            tree_pages = result.num_pages + sum(len(h.host_ids) for h in result.host_path)
            prefix = self.cache._aligned(req.all_ids[:req.num_tokens - 1])
            req.fetch = self.disk.start(req, list(prefix), tree_pages)
        req.num_computed_tokens = len(req.page_ids) * self.page_size
        return req.num_computed_tokens

    def _load_back(self, req: Request, host_path: list, keep_free_pages: int) -> None:
        """The loaded pages join req's tree pages at once; the forward waits per layer (KVCache.wait_ready)."""
        load = self.tier.start_load(host_path, self._take_pages, self.num_available_pages - keep_free_pages)
        if load is None:
            return
        self.cache.lock(load.node)
        self.cache.unlock(req.last_node)
        req.last_node = load.node
        req.page_ids.extend(load.device_ids)
        req.num_tree_pages = len(req.page_ids)
        req.loads.append(load)
        req.num_host_hit_tokens = len(load.device_ids) * self.page_size

    def _take_pages(self, n: int, fp8: bool = False) -> list[int] | None:
        free = self.pool.num_free_for(fp8)
        if n > free:
            self.pool.free(self.cache.evict(n - free, self._demote))
        return self.pool.allocate(n, fp8)

    @property
    def _demote(self):
        return self.tier.demote if self.tier is not None else None

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Cover num_tokens positions with pages, evicting if needed; False (nothing changed) if impossible."""
        need = self.pages_for(num_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        decode = num_tokens == req.num_computed_tokens + 1 == req.num_tokens and bool(req.output_ids)
        pages = self._take_pages(need, fp8=decode and self.pool.num_fp8_pages > 0)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def commit(self, req: Request) -> None:
        """Give req's computed full pages to the tree (duplicates freed for the tree's); the lock moves along."""
        if not self.enable_cache:
            return
        num_full = self.num_settled_tokens(req) // self.page_size
        if self.pool.num_fp8_pages:
            num_full = self.pool.num_model_prefix(req.page_ids[:num_full])
        if num_full <= req.num_tree_pages:
            return
        key = self._key(req.all_ids[:num_full * self.page_size + self.paired_keys])
        result = self.cache.insert(key, req.page_ids[:num_full])
        overlap = result.num_overlap_tokens // self.page_size
        dup = req.page_ids[req.num_tree_pages:overlap]
        self.pool.free([p for p, t in zip(dup, result.page_ids[req.num_tree_pages:overlap]) if p != t])
        req.page_ids[:num_full] = result.page_ids
        self.cache.lock(result.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = result.node
        req.num_tree_pages = num_full
        if self.tier is not None:
            self.tier.on_insert(result.node)

    def free(self, req: Request) -> None:
        self.commit(req)
        self.pool.free(req.page_ids[req.num_tree_pages:])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.page_ids, req.num_tree_pages, req.last_node = [], 0, None

    def discard(self, req: Request) -> None:
        """Release req's KV committing nothing (it read pages a failed load never filled)."""
        self.pool.free(req.page_ids[req.num_tree_pages:])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.page_ids, req.num_tree_pages, req.last_node, req.loads = [], 0, None, []

    def finish_loads(self, readers: list[Request]) -> list[Request]:
        """After a step: release its host loads; discard and return the `readers` of a failed one."""
        if self.tier is None:
            return []
        for req in readers:
            for load in req.loads:
                load.handle.wait()
        failed = self.tier.finish_loads(wait=True)
        victims = [r for r in readers if any(load.handle.failed for load in r.loads)]
        for req in victims:
            self.discard(req)
        for req in readers:
            req.loads = []
        for load in failed:
            self.pool.free(self.tier.invalidate(load))
        return victims

    def poll_fetches(self) -> None:
        if self.disk is not None and self.disk.fetches:
            self.disk.poll()

    def flush(self) -> bool:
        if self.cache.num_locked_pages:
            return False
        self.pool.free(self.cache.reset())
        return True

    def purge(self, page_ids: set[int]) -> set[int]:
        """Remove unlocked nodes holding any of `page_ids`, with subtrees; returns those still in the tree."""
        while True:
            hits = [n for n in self.cache.nodes() if n.page_ids and not page_ids.isdisjoint(n.page_ids)]
            node = next((n for n in hits if n.lock_ref == 0), None)
            if node is None:
                return {p for n in hits for p in n.page_ids} & page_ids
            self.pool.free(self.cache.remove(node))

    def num_settled_tokens(self, req: Request) -> int:
        """Leading positions whose KV no later step rewrites (with paired keys the draft's KV lags by one)."""
        return max(req.num_computed_tokens - self.paired_keys, 0)

    def _key(self, token_ids: list[int]) -> list[int]:
        return paired_key(token_ids) if self.paired_keys else token_ids

    def _may_match(self, req: Request) -> bool:
        # Prompt logprobs need every position's logits, which the cache does not keep.
        return self.enable_cache and not req.wants_prompt_logprobs

    def check_invariants(self, requests: list[Request]) -> None:
        self.cache.check()
        free = self.pool.free_ids()
        tree = self.cache.all_page_ids()
        private = [p for r in requests for p in r.page_ids[r.num_tree_pages:]]
        owned = free + tree + private
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) == self.num_pages, (
            f"free {len(free)} + cached {len(tree)} + private {len(private)} != {self.num_pages}")
        tree_set = set(tree)
        for r in requests:
            assert all(p in tree_set for p in r.page_ids[:r.num_tree_pages]), "request maps an uncached page"
        if not any(r.page_ids for r in requests) and not (self.tier and self.tier.loads):
            assert self.cache.num_locked_pages == 0, "locked pages with no request holding KV"
        if self.tier is not None:
            self.tier.check()
