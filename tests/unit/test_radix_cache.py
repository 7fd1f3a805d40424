"""RadixCache: page-aligned match/insert/split, locking, LRU eviction; hypothesis model test."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from radixserve.engine.kv_manager import KVManager
from radixserve.engine.radix_cache import RadixCache
from radixserve.engine.request import Request
from radixserve.sampling_params import SamplingParams

P = 2


def test_match_truncates_to_pages_and_splits():
    cache = RadixCache(P)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert cache.match([1, 2, 3, 4, 9]).page_ids == [10, 11]   # partial page ignored
    assert cache.match([1]).page_ids == []                     # shorter than a page
    assert cache.match([1, 2, 3, 9]).page_ids == [10]          # split after one page
    cache.check()
    assert cache.num_cached_pages == 3


def test_insert_returns_overlap_and_keeps_tree_pages():
    cache = RadixCache(P)
    cache.insert([1, 2, 3, 4], [10, 11])
    res = cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert res.num_overlap_tokens == 4
    assert res.page_ids == [10, 11, 22]
    cache.check()


def test_lru_eviction_skips_locked_paths():
    cache = RadixCache(P)
    a = cache.insert([1, 2, 3, 4], [10, 11]).node
    cache.insert([5, 6], [12])
    cache.insert([7, 8], [13])
    cache.match([5, 6])                  # touch: [7, 8] is now least recently used
    cache.lock(a)
    assert cache.evict(1) == [13]
    assert cache.evict(10) == [12]       # locked [1..4] survives
    cache.unlock(a)
    assert sorted(cache.evict(10)) == [10, 11]
    cache.check()
    assert cache.num_cached_pages == 0
    assert cache.num_evicted_pages == 4


def test_split_keeps_lock_counts():
    cache = RadixCache(P)
    node = cache.insert([1, 2, 3, 4, 5, 6], [1, 2, 3]).node
    cache.lock(node)
    cache.match([1, 2, 9, 9])            # splits the locked node
    cache.check()
    assert cache.num_locked_pages == 3
    cache.unlock(node)
    cache.check()
    assert cache.num_locked_pages == 0


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "finish", "evict"]), tokens), max_size=30))
def test_kv_manager_ownership_invariant_holds(ops):
    """Random admit/commit/finish/evict sequences: every page keeps exactly one owner, and
    every page a request maps really holds the tokens of its key (checked via a shadow)."""
    kv = KVManager(num_pages=24, page_size=P)
    shadow: dict[int, tuple[int, ...]] = {}   # page id -> tokens written into it
    live: list[Request] = []
    for i, (op, toks) in enumerate(ops):
        if op == "add" and toks:
            req = Request(f"r{i}", toks, SamplingParams(), 0, 4, 0.0)
            kv.match(req)
            if not kv.allocate(req, len(toks)):
                kv.free(req)
                continue
            for j in range(req.num_tree_pages, len(req.page_ids)):
                shadow[req.page_ids[j]] = tuple(toks[j * P:(j + 1) * P])
            req.num_computed_tokens = len(toks)
            kv.commit(req)
            live.append(req)
        elif op == "finish" and live:
            kv.free(live.pop(0))
        elif op == "evict":
            kv.pool.free(kv.cache.evict(len(toks)))
        kv.check_invariants(live)
        for req in live:
            for j, page in enumerate(req.page_ids[:len(req.prompt_ids) // P]):
                assert shadow[page] == tuple(req.prompt_ids[j * P:(j + 1) * P])
    for req in live:
        kv.free(req)
    kv.check_invariants([])
    assert kv.pool.num_free + kv.cache.num_cached_pages == 24


def test_paired_keys_share_a_page_only_with_the_token_after_it():
    """EAGLE (C51): a page's draft KV at its last position was computed from the token after the page, so
    pages are keyed by token pairs; they enter the tree once that token is computed, and a prompt that
    continues the page differently does not hit it."""
    def admit(rid, toks, computed):
        req = Request(rid, toks, SamplingParams(), 0, 4, 0.0)
        hit = kv.match(req)
        assert kv.allocate(req, len(toks))
        req.num_computed_tokens = computed
        kv.commit(req)
        return req, hit

    kv = KVManager(num_pages=24, page_size=P, paired_keys=True)
    first, _ = admit("a", list(range(1, 2 * P + 2)), 2 * P)   # 2 pages computed, the token after them not yet
    assert first.num_tree_pages == 1
    first.num_computed_tokens = 2 * P + 1
    kv.commit(first)
    assert first.num_tree_pages == 2
    same, hit_same = admit("b", list(range(1, 2 * P + 3)), 0)
    other, hit_other = admit("c", list(range(1, 2 * P + 1)) + [99, 98], 0)
    assert (hit_same, hit_other) == (2 * P, P)
    for req in (first, same, other):
        kv.free(req)
    kv.check_invariants([])
