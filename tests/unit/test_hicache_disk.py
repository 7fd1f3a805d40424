"""Disk KV tier (engine/hicache_disk.py) over the fake runner: page names, a warm restart through WAITING_FOR_KV, failed and partial fetches (C30), abort while waiting, ownership."""
from __future__ import annotations

import random

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine.hicache_disk import page_names
from radixserve.engine.request import Status
from radixserve.engine_config import EngineConfig
from tests.unit.fake_runner import FakeDiskKV, FakeHostKV, FakeRunner
from tests.unit.test_engine import VOCAB, reference, run_all
from tests.unit.test_hicache import P, check_all_idle, greedy

PROMPT = [random.Random(9).randrange(VOCAB) for _ in range(8 * P + 1)]


def make(store: dict, num_pages=24, host_pages=64):
    runner = FakeRunner(num_pages, P, VOCAB)
    runner.host_kv = FakeHostKV(runner, host_pages)
    runner.host_kv.disk = FakeDiskKV(runner.host_kv, store)
    return Engine(EngineConfig(page_size=P, chunked_prefill_size=32), runner), runner.host_kv.disk


def saved_store() -> dict:
    """A disk store an engine filled by serving PROMPT (what a restart finds)."""
    store: dict = {}
    first, _ = make(store)
    first.add_request("a", PROMPT, greedy(6))
    run_all(first)
    return store


def test_page_names_are_a_hash_chain_over_page_content():
    a = page_names(list(range(10)), 4)
    assert len(a) == 2 and len(set(a)) == 2
    assert page_names(list(range(8)) + [99, 98], 4) == a            # partial page ignored
    assert page_names([7] + list(range(1, 10)), 4)[1] != a[1]       # page 1 names its prefix too
    assert page_names(list(range(10)), 4, start_page=1) == a[1:]


def test_a_restarted_engine_finds_its_pages_on_disk():
    store: dict = {}
    first, _ = make(store)
    first.add_request("a", PROMPT, greedy(6))
    tokens, _ = run_all(first)["a"]
    assert len(store) >= 8
    engine, disk = make(store)                       # a fresh engine: empty radix tree
    engine.add_request("b", PROMPT, greedy(6))
    states = []
    results = run_all(engine, on_step=lambda _: states.append(engine.stats()["num_waiting_for_kv"]))
    again, out = results["b"]
    assert again == tokens == reference(PROMPT, 6)
    assert disk.num_fetches == 1 and states[0] == 1  # it waited for KV, then ran
    assert out.num_cached_tokens == 8 * P and out.num_cached_tokens_host == 8 * P
    stats = engine.stats()
    assert stats["hicache_disk_fetch_pages"] == 8 and stats["hicache_disk_failed_pages"] == 0
    check_all_idle(engine)


@pytest.mark.parametrize("landed", [0, 3])
def test_a_failed_or_short_fetch_is_recomputed_and_counts_only_what_landed(landed):
    """C30: the fetch is cut after `landed` pages; the rest is computed, not reported as hit."""
    store = saved_store()
    engine, disk = make(store)
    disk.limit = landed
    engine.add_request("b", PROMPT, greedy(6))
    tokens, out = run_all(engine)["b"]
    assert tokens == reference(PROMPT, 6)
    assert out.num_cached_tokens == landed * P
    assert engine.stats()["hicache_disk_failed_pages"] == 8 - landed
    check_all_idle(engine)


def test_abort_while_waiting_for_kv_frees_everything():
    store = saved_store()
    engine, disk = make(store)
    disk.deferred = True
    engine.add_request("b", PROMPT, greedy(6))
    engine.step()
    assert engine.requests["b"].status is Status.WAITING_FOR_KV
    engine.check_invariants()
    final = engine.abort("b")
    assert final.finished and final.finish_reason == "abort"
    disk.complete()
    engine.kv.poll_fetches()                           # the fetch still lands, into the tree
    assert engine.kv.cache.match_len(PROMPT) == 8 * P
    assert not engine.has_unfinished()
    check_all_idle(engine)


def test_two_requests_for_one_prefix_share_one_fetch():
    store = saved_store()
    engine, disk = make(store)
    disk.deferred = True
    engine.add_request("b", PROMPT, greedy(6))
    engine.add_request("c", PROMPT[:-1] + [1, 2], greedy(6))
    engine.step()
    assert disk.num_fetches == 1
    disk.deferred = False
    disk.complete()
    results = run_all(engine)
    assert results["b"][0] == reference(PROMPT, 6)
    assert results["c"][0] == reference(PROMPT[:-1] + [1, 2], 6)
    check_all_idle(engine)


def test_storage_dir_needs_the_host_tier():
    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        EngineConfig(hicache_storage_dir="/tmp/x")
