"""Host KV tier (engine/hicache.py) over the fake runner: demotion, load-back, write policies, pinning (C29), failed loads (C30), exhaustion (C31), per-tier hits (C32), and page ownership in both tiers."""
from __future__ import annotations

import random

import pytest

from radixserve.chaos.engine_faults import EngineFaults
from radixserve.chaos.tier_faults import AllocFaults
from radixserve.engine.engine import Engine
from radixserve.engine.request import Request
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeHostKV, FakeRunner
from tests.unit.test_engine import VOCAB, assert_idle_pool, reference, run_all

P = 4
POLICIES = ("write_through", "write_through_selective", "write_back")


def make(num_pages=24, host_pages=200, policy="write_through", **cfg):
    cfg.setdefault("chunked_prefill_size", 32)
    runner = FakeRunner(num_pages, P, VOCAB)
    runner.host_kv = FakeHostKV(runner, host_pages)
    engine = Engine(EngineConfig(page_size=P, hicache_write_policy=policy, **cfg), runner)
    return engine, runner.host_kv


def greedy(max_tokens=4):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def serve(engine, prompts, max_tokens=4, start=0):
    """Run prompts one at a time; returns [(tokens, final output)] in order."""
    outs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{start + i}", prompt, greedy(max_tokens))
        outs.append(run_all(engine)[f"r{start + i}"])
    return outs


def check_all_idle(engine):
    assert_idle_pool(engine)
    tier = engine.kv.tier
    assert not tier.loads and not tier.pinned
    tier.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_match_the_reference_while_every_round_evicts_and_reloads(policy):
    rng = random.Random(1)
    engine, io = make(policy=policy)
    sessions = [[rng.randrange(VOCAB) for _ in range(7 * P + 1)] for _ in range(4)]
    n, turns = 0, 3 if policy == "write_through_selective" else 1   # selective: hit it twice
    for _ in range(4):                 # each round: 4 x 8 pages > the 24-page device pool
        for s in sessions:
            for _ in range(turns):
                engine.add_request(f"r{n}", s, greedy(6))
                tokens, _ = run_all(engine)[f"r{n}"]
                assert tokens == reference(s, 6)
                n += 1
    stats = engine.stats()
    assert stats["hicache_loads"] > 0 and io.num_loads == stats["hicache_loads"]
    assert stats["num_cached_tokens_host"] > 0
    assert stats["num_cached_tokens_device"] + stats["num_cached_tokens_host"] == stats["num_cached_tokens"]
    check_all_idle(engine)


def test_a_prefix_evicted_from_the_device_hits_in_host_and_counts_there():
    """C32: a sentinel pushed off the device by noise comes back from host, counted per tier."""
    rng = random.Random(2)
    engine, _ = make()
    sentinel = [rng.randrange(VOCAB) for _ in range(8 * P + 1)]
    (first, out1), = serve(engine, [sentinel])
    assert out1.num_cached_tokens == 0
    noise = [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(4)]
    serve(engine, noise, start=1)
    assert engine.kv.cache.match(sentinel).page_ids == []      # gone from the device
    before = engine.stats()
    (again, out2), = serve(engine, [sentinel], start=10)
    after = engine.stats()
    assert again == first
    assert out2.num_cached_tokens >= len(sentinel) - P - 1
    assert after["num_cached_tokens_host"] - before["num_cached_tokens_host"] == out2.num_cached_tokens
    assert after["hicache_load_pages"] - before["hicache_load_pages"] == out2.num_cached_tokens // P
    check_all_idle(engine)


def test_under_page_pressure_the_head_of_a_host_match_loads_instead_of_nothing():
    """A 16-page prefix back from host while another request holds most of the 24-page pool:
    the pages that fit load now (the node split where they end), the rest at a later match,
    so the prefix is served from the tier, not recomputed (all-or-nothing loading gave 0)."""
    rng = random.Random(5)
    engine, _ = make()
    sentinel = [rng.randrange(VOCAB) for _ in range(16 * P + 1)]
    serve(engine, [sentinel])
    serve(engine, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(4)], start=1)
    assert engine.kv.cache.match(sentinel).page_ids == []          # gone from the device
    engine.add_request("busy", [rng.randrange(VOCAB) for _ in range(11 * P)], greedy(12))
    while not engine.scheduler.running or engine.scheduler.running[0].is_prefilling:
        engine.step()
    assert engine.kv.num_available_pages < 16, "the whole prefix must not fit"
    before = engine.stats()["hicache_loads"]
    engine.add_request("again", sentinel, greedy(6))
    outs = run_all(engine)
    tokens, out = outs["again"]
    assert tokens == reference(sentinel, 6)
    assert out.num_cached_tokens >= 8 * P, out.num_cached_tokens
    stats = engine.stats()
    assert stats["hicache_loads"] >= before + 2, "the prefix came back in more than one load"
    assert stats["hicache_partial_loads"] >= 1
    check_all_idle(engine)


def test_a_failed_load_is_recomputed_and_never_counted_as_a_hit():
    """C30: the load writes wrong KV and says so; the request reruns without host hits."""
    rng = random.Random(3)
    engine, io = make()
    sentinel = [rng.randrange(VOCAB) for _ in range(8 * P + 1)]
    serve(engine, [sentinel])
    serve(engine, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(4)], start=1)
    io.fail_next = 1
    before = engine.stats()
    (tokens, out), = serve(engine, [sentinel], max_tokens=6, start=10)
    after = engine.stats()
    assert tokens == reference(sentinel, 6)
    assert out.num_cached_tokens == 0
    assert after["hicache_failed_loads"] - before["hicache_failed_loads"] == 1
    assert after["num_cached_tokens_host"] == before["num_cached_tokens_host"]
    check_all_idle(engine)
    # The host copy itself was fine: the next return loads it.
    serve(engine, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(4)], start=20)
    (tokens, out), = serve(engine, [sentinel], max_tokens=6, start=30)
    assert tokens == reference(sentinel, 6) and out.num_cached_tokens > 0
    check_all_idle(engine)


def test_concurrent_readers_of_a_failed_load_are_all_recomputed():
    rng = random.Random(4)
    engine, io = make(num_pages=40)
    shared = [rng.randrange(VOCAB) for _ in range(6 * P)]
    serve(engine, [shared + [1, 2, 3]])
    serve(engine, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(5)], start=1)
    io.fail_next = 1
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(P + 1)] for _ in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, greedy(5))
    results = run_all(engine)
    for i, p in enumerate(prompts):
        assert results[f"c{i}"][0] == reference(p, 5)
    check_all_idle(engine)


def test_host_pages_a_load_reads_are_pinned_against_eviction():
    """C29: while a load is in flight its source host pages are never freed or reused."""
    rng = random.Random(5)
    engine, io = make(num_pages=24, host_pages=12, policy="write_back")
    kv = engine.kv
    a = [rng.randrange(VOCAB) for _ in range(8 * P + 1)]
    serve(engine, [a])
    serve(engine, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(2)], start=1)
    assert kv.cache.match(a).page_ids == [] and kv.cache.match(a).host_path
    io.deferred = True
    req = Request("x", list(a), greedy(), 0, 4, 0.0)
    kv.match(req)
    assert req.num_host_hit_tokens == 8 * P and kv.tier.loads
    pinned = set(kv.tier.pinned)
    # The load's own device allocation evicted a device leaf whose write-back found the host
    # pool full of pinned pages; then more host pressure while the load is pending.
    for k in range(4):
        toks = [rng.randrange(VOCAB) for _ in range(4 * P)]
        filler = Request(f"f{k}", toks + [0], greedy(), 0, 4, 0.0)
        assert kv.allocate(filler, len(toks))
        filler.num_computed_tokens = len(toks)
        kv.free(filler)
    assert kv.tier.counters["hicache_evictions_skipped_pinned"] > 0
    assert pinned <= set(kv.cache.all_host_ids()) and not pinned & set(kv.tier.pool.free_ids())
    io.complete()
    assert kv.finish_loads([req]) == []
    assert not kv.tier.pinned
    ctx = [io.runner.slots[p * P + o][0] for p in req.page_ids for o in range(P)]
    assert ctx == a[:8 * P]
    kv.free(req)
    kv.check_invariants([])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("host_pages", [12, 24, 48])
def test_host_exhaustion_and_failed_host_allocations_keep_serving(policy, host_pages):
    """C31: a small host pool and half the host allocations failing: no crash, right outputs, and
    recurring sessions still hit host."""
    rng = random.Random(6)
    engine, _ = make(num_pages=24, host_pages=host_pages, policy=policy)
    engine.kv.tier.fail_alloc = AllocFaults(0.5, random.Random(0))
    sessions = [[rng.randrange(VOCAB) for _ in range(5 * P + 1)] for _ in range(2)]
    n, turns = 0, 3 if policy == "write_through_selective" else 1   # selective: hit it twice
    for _ in range(6):
        noise = [[rng.randrange(VOCAB) for _ in range(6 * P)] for _ in range(3)]
        prompts = [s for s in sessions for _ in range(turns)] + noise
        for p in prompts:
            engine.add_request(f"r{n}", p, greedy(4))
            assert run_all(engine)[f"r{n}"][0] == reference(p, 4)
            n += 1
    stats = engine.stats()
    if policy != "write_through_selective":   # selective copies twice here, both may succeed
        assert stats["hicache_host_alloc_failures"] > 0
    assert stats["num_cached_tokens_host"] > 0
    check_all_idle(engine)


def test_write_policies_decide_when_pages_reach_host():
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(4 * P + 1)]
    through, io_t = make(policy="write_through")
    serve(through, [prompt])
    assert io_t.num_backups > 0
    selective, io_s = make(policy="write_through_selective")
    serve(selective, [prompt])
    assert io_s.num_backups == 0
    serve(selective, [prompt, prompt], start=1)     # hits 1 and 2: the second copies it
    assert io_s.num_backups > 0
    back, io_b = make(policy="write_back")
    serve(back, [prompt])
    assert io_b.num_backups == 0
    serve(back, [[rng.randrange(VOCAB) for _ in range(8 * P)] for _ in range(3)], start=1)
    assert io_b.num_backups > 0                     # copied as the device evicted it
    for engine in (through, selective, back):
        check_all_idle(engine)


def test_flush_drops_both_tiers():
    engine, _ = make()
    serve(engine, [[5] * (6 * P + 1)])
    assert engine.kv.tier.pool.num_free < engine.kv.tier.pool.num_pages
    assert engine.flush_cache()
    assert engine.kv.tier.pool.num_free == engine.kv.tier.pool.num_pages
    check_all_idle(engine)


def test_hicache_faults_need_the_tier():
    from radixserve.errors import InvalidRequest
    faults = EngineFaults()
    Engine(EngineConfig(page_size=P), FakeRunner(24, P, VOCAB), hooks=[faults])
    for arm in (faults.arm_hicache_h2d, faults.arm_hicache_host_alloc):
        with pytest.raises(InvalidRequest, match="host KV tier is off"):
            arm()
    faults.disarm_hicache_host_alloc()      # clearing all faults must not fail without it


def test_bad_tier_settings_are_refused():
    with pytest.raises(ValueError, match="hicache"):
        EngineConfig(enable_hierarchical_cache=True, hicache_ratio=0)
    with pytest.raises(ValueError, match="radix cache"):
        EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    # a decode worker may keep a host tier (C27's offload variant, tests/unit/test_pd_handshake.py)
    assert EngineConfig(enable_hierarchical_cache=True, disaggregation_mode="decode").enable_hierarchical_cache
