"""ApproxPrefixTree: matching, per-tenant sizes, LRU + TTL eviction, bounded memory."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.router.prefix_tree import ApproxPrefixTree, PrefixMatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_invariants(tree: ApproxPrefixTree) -> None:
    """Walk the tree: sizes add up, every non-root node holds a tenant, a tenant on a node is
    on its parent with an access time no older, edges are non-empty and keyed by their head."""
    total, per_tenant = 0, {}
    stack = [tree._root]
    while stack:
        node = stack.pop()
        for head, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == head
            assert child.tenants, "empty node left in the tree"
            total += len(child.edge)
            for tenant, seen in child.tenants.items():
                per_tenant[tenant] = per_tenant.get(tenant, 0) + len(child.edge)
                if node is not tree._root:
                    assert node.tenants[tenant] >= seen
            stack.append(child)
    assert tree.size == total
    assert {t: tree.tenant_size(t) for t in tree.tenants()} == per_tenant


def test_match_longest_prefix_per_tenant():
    tree = ApproxPrefixTree(1000, 60.0, clock=FakeClock())
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello wor") == PrefixMatch(9, {"a": 9, "b": 6})
    assert tree.match("hello thx") == PrefixMatch(8, {"a": 6, "b": 8})
    assert tree.match("help") == PrefixMatch(3, {"a": 3, "b": 3})
    assert tree.match("xyz") == PrefixMatch(0, {})
    assert tree.match("") == PrefixMatch(0, {})
    check_invariants(tree)


def test_token_keys_and_text_keys():
    tree = ApproxPrefixTree(1000, 60.0, clock=FakeClock())
    tree.insert([1, 2, 3, 4], "a")
    tree.insert((1, 2, 9), "b")
    assert tree.match([1, 2, 3, 4, 5]) == PrefixMatch(4, {"a": 4, "b": 2})
    assert tree.match([7]).matched_len == 0
    assert tree.size == 5  # [1, 2] shared, [3, 4] and [9] below it
    check_invariants(tree)


def test_sizes_count_edge_lengths_once():
    tree = ApproxPrefixTree(1000, 60.0, clock=FakeClock())
    tree.insert("abcdef", "a")
    tree.insert("abcdef", "a")
    assert tree.size == 6 and tree.tenant_size("a") == 6
    tree.insert("abcxyz", "b")
    assert tree.size == 9  # "abc" + "def" + "xyz"
    assert tree.tenant_size("a") == 6 and tree.tenant_size("b") == 6
    tree.insert("abc", "c")  # ends exactly at the split point
    assert tree.size == 9 and tree.tenant_size("c") == 3
    assert tree.tenant_size("nobody") == 0
    check_invariants(tree)


def test_lru_evicts_least_recently_used_leaf_first():
    clock = FakeClock()
    tree = ApproxPrefixTree(12, 1000.0, clock=clock)
    tree.insert("aaaa", "w1")
    clock.now = 1
    tree.insert("bbbb", "w2")
    clock.now = 2
    tree.insert("aaaa", "w1")  # refresh: "bbbb" is now the oldest
    clock.now = 3
    tree.insert("cccccc", "w1")  # 14 > 12: evict down to 12 - 12 // 8 = 11
    assert tree.match("bbbb").matched_len == 0
    assert tree.match("aaaa") == PrefixMatch(4, {"w1": 4})
    assert tree.match("cccccc") == PrefixMatch(6, {"w1": 6})
    assert tree.size == 10 and tree.tenant_size("w2") == 0
    check_invariants(tree)


def test_lru_is_global_across_tenants():
    clock = FakeClock()
    tree = ApproxPrefixTree(100, 1000.0, clock=clock)
    for t, (key, tenant) in enumerate([("aaaa", "w1"), ("bbbb", "w2"), ("cccc", "w1")]):
        clock.now = t
        tree.insert(key, tenant)
    tree.max_size = 8
    tree.evict()  # the oldest leaf overall goes, not one per tenant
    assert tree.match("aaaa").matched_len == 0
    assert tree.match("bbbb").tenants == {"w2": 4}
    assert tree.match("cccc").tenants == {"w1": 4}
    check_invariants(tree)


def test_a_shared_node_goes_only_when_its_last_tenant_does():
    clock = FakeClock()
    tree = ApproxPrefixTree(100, 1000.0, clock=clock)
    tree.insert("shared", "old")
    clock.now = 1
    tree.insert("shared", "new")
    clock.now = 2
    tree.insert("zz", "new")
    tree.max_size = 7  # 8 held: dropping "old" frees nothing, so "shared" itself must go
    tree.evict()
    assert tree.size == 2 and tree.tenant_size("old") == 0
    assert tree.match("zz").tenants == {"new": 2}
    check_invariants(tree)
    tree.max_size = 100
    clock.now = 3
    tree.insert("shared", "new")
    clock.now = 4
    tree.insert("shared", "old")
    tree.max_size = 7
    tree.evict()  # now "zz" is the oldest leaf
    assert tree.match("shared").tenants == {"new": 6, "old": 6} and tree.size == 6
    check_invariants(tree)


def test_ttl_expires_entries_and_insert_refreshes():
    clock = FakeClock()
    tree = ApproxPrefixTree(1000, 10.0, clock=clock)
    tree.insert("system prompt A", "w1")
    tree.insert("system prompt B", "w2")
    clock.now = 8
    tree.insert("system prompt B", "w2")
    clock.now = 12  # A last used at 0: expired; B at 8: live
    assert tree.match("system prompt A") == PrefixMatch(14, {"w2": 14})
    tree.evict()
    assert tree.tenants() == ["w2"] and tree.size == len("system prompt B")
    check_invariants(tree)
    clock.now = 17.5  # B last used at 8
    assert tree.match("system prompt B").matched_len == 15
    clock.now = 18.5
    assert tree.match("system prompt B").matched_len == 0


def test_insert_sweeps_expired_entries_without_an_explicit_evict():
    clock = FakeClock()
    tree = ApproxPrefixTree(1000, 10.0, clock=clock)
    tree.insert("stale entry", "w1")
    clock.now = 20  # past ttl and past the half-ttl sweep period
    tree.insert("fresh", "w2")
    assert tree.tenants() == ["w2"] and tree.size == 5
    check_invariants(tree)


def test_remove_tenant():
    tree = ApproxPrefixTree(1000, 60.0, clock=FakeClock())
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    tree.insert("abcdeg", "b")
    tree.remove_tenant("b")
    assert tree.match("abcxyz") == PrefixMatch(3, {"a": 3})
    assert tree.match("abcdeg") == PrefixMatch(5, {"a": 5})
    assert tree.tenants() == ["a"] and tree.size == 6
    check_invariants(tree)
    tree.remove_tenant("a")
    assert tree.size == 0 and tree.tenants() == []


def test_key_longer_than_the_budget_is_cut_to_seven_eighths():
    clock = FakeClock()
    tree = ApproxPrefixTree(48, 60.0, clock=clock)
    tree.insert("y" * 40, "b")
    clock.now = 1
    tree.insert("x" * 500, "a")
    assert tree.size == 42  # 48 - 48 // 8; the older "y" key was evicted to make room
    assert tree.match("x" * 500) == PrefixMatch(42, {"a": 42})


def test_memory_stays_bounded_under_unbounded_distinct_inserts():
    clock = FakeClock()
    tree = ApproxPrefixTree(2000, 1e9, clock=clock)
    rng = random.Random(0)
    prefixes = ["".join(rng.choice("abcd") for _ in range(rng.randint(0, 60))) for _ in range(30)]
    for i in range(3000):
        clock.now += 0.01
        key = rng.choice(prefixes) + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 80)))
        tree.insert(key, f"w{rng.randrange(4)}")
        assert tree.size <= 2000
        if i % 500 == 0:
            check_invariants(tree)
    check_invariants(tree)
    assert tree.size > 2000 - 2000 // 8 - 200  # it still holds most of its budget
    # the newest key is always kept in full
    assert tree.match(key).matched_len == len(key)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=30), st.integers(0, 2),
                          st.floats(0, 5)), max_size=60),
       st.integers(1, 40))
def test_random_operations_keep_invariants(ops, max_size):
    clock = FakeClock()
    tree = ApproxPrefixTree(max_size, 20.0, clock=clock)
    for key, tenant, dt in ops:
        clock.now += dt
        tree.insert(key, f"w{tenant}")
        assert tree.size <= max_size
        check_invariants(tree)
    tree.evict()
    check_invariants(tree)
    tree.remove_tenant("w0")
    assert "w0" not in tree.tenants()
    check_invariants(tree)
