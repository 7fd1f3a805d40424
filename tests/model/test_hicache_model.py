"""The host KV tier on the real runner (runner/host_kv.py): greedy outputs equal tier-off while every round evicts and reloads, under per-layer load delays; a failed load is recomputed; and the per-layer readiness wait is what keeps a forward from reading pages before they land (with the test-only switch that skips it, the same scenario reads garbage)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from radixserve.chaos.tier_faults import CopyFaults, L3Fault
from radixserve.runner.kv_cache import KVPages
from radixserve.sampling_params import SamplingParams
from tests.model.test_parity import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
SMALL_POOL = {"max_total_tokens": 20 * 16, "page_size": 16}   # 20 pages: two sessions at most


def sessions(n=4, length=110, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def generate(engine, prompts, tag):
    """One request per prompt, all at once; {index: [(token, logprob)]}."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    out = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id[len(tag):])] += [(t.token_id, t.logprob) for t in o.new_logprobs]
        engine.check_invariants()
    return out


def assert_same(a, b):
    for i in a:
        assert [t for t, _ in a[i]] == [t for t, _ in b[i]], f"prompt {i}"
        assert max(abs(x - y) for (_, x), (_, y) in zip(a[i], b[i])) < 1e-4


def rounds(engine, prompts, n=3):
    return [generate(engine, prompts, f"r{k}-") for k in range(n)]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_outputs_equal_tier_off_while_every_round_evicts_and_reloads(tiny_llama_dir, policy):
    prompts = sessions()
    off = rounds(make_engine(tiny_llama_dir, **SMALL_POOL), prompts)
    engine = make_engine(tiny_llama_dir, enable_hierarchical_cache=True,
                         hicache_write_policy=policy, **SMALL_POOL)
    engine.runner.host_kv.fault = CopyFaults(h2d_delay_ms=3)       # every layer lands late
    on = rounds(engine, prompts)
    for a, b in zip(off, on):
        assert_same(a, b)
    stats = engine.stats()
    assert stats["hicache_loads"] > 0 and stats["num_cached_tokens_host"] > 0
    assert stats["hicache_failed_loads"] == 0
    engine.check_invariants()


def test_a_failed_load_is_recomputed(tiny_llama_dir):
    prompts = sessions(seed=1)
    off = rounds(make_engine(tiny_llama_dir, **SMALL_POOL), prompts, 2)
    engine = make_engine(tiny_llama_dir, enable_hierarchical_cache=True, **SMALL_POOL)
    first = generate(engine, prompts, "a")
    engine.runner.host_kv.fault = CopyFaults(h2d_fail_probability=0.5)
    second = generate(engine, prompts, "b")
    assert_same(off[0], first)
    assert_same(off[1], second)
    stats = engine.stats()
    assert stats["hicache_failed_loads"] > 0
    engine.check_invariants()


def poison_free_pages(engine):
    """Overwrite every free device page with noise, so an early read cannot see old KV."""
    kv, free = engine.runner.kv, engine.kv.pool.free_ids()
    data = kv.export_pages(free)
    gen = torch.Generator().manual_seed(0)
    kv.import_pages(free, KVPages(torch.randn(data.k.shape, generator=gen).to(data.k.dtype),
                                  torch.randn(data.v.shape, generator=gen).to(data.v.dtype), data.side))


def first_token_after_reload(tiny_llama_dir, skip_wait: bool):
    """Serve A, push it to host, poison the free pages, serve A again with its load held back
    until the forward pass has returned; the (token, logprob) pairs of the second run."""
    engine = make_engine(tiny_llama_dir, enable_hierarchical_cache=True, **SMALL_POOL)
    a, *noise = sessions(n=3, seed=2)
    generate(engine, [a], "a")
    generate(engine, noise, "n")
    assert not engine.kv.cache.match(a).page_ids and engine.kv.cache.match(a).host_path
    poison_free_pages(engine)
    runner, host = engine.runner, engine.runner.host_kv
    if skip_wait:
        runner.kv.skip_readiness_wait = True
        hold, forward_done = threading.Event(), threading.Event()
        host.fault = CopyFaults(hold=hold)
        run = runner.run
        runner.run = lambda batch: (out := run(batch), forward_done.set())[0]
        threading.Thread(target=lambda: (forward_done.wait(), hold.set()), daemon=True).start()
    else:
        host.fault = CopyFaults(h2d_delay_ms=20)
    out = generate(engine, [a], "b")[0]
    assert engine.stats()["num_cached_tokens_host"] > 0
    engine.check_invariants()
    return out


def test_the_readiness_wait_is_what_keeps_early_reads_out(tiny_llama_dir):
    reference = generate(make_engine(tiny_llama_dir, **SMALL_POOL), sessions(n=1, seed=2), "r")[0]
    waited = first_token_after_reload(tiny_llama_dir, skip_wait=False)
    assert_same({0: reference}, {0: waited})
    skipped = first_token_after_reload(tiny_llama_dir, skip_wait=True)
    assert abs(skipped[0][1] - reference[0][1]) > 1e-3, "reading unloaded pages went unnoticed"


@pytest.mark.parametrize("l3_mode", [None, "fail", "fail_chunk"])
def test_a_restart_reads_the_disk_tier_back(tiny_llama_dir, tmp_path, l3_mode):
    """Warm start: a fresh engine over the same --hicache-storage-dir serves the prompts from
    disk (through WAITING_FOR_KV and the host tier) with the tier-off outputs; a failed or cut
    fetch (hicache.l3.get) is recomputed and counts only what landed (C30)."""
    prompts = sessions(n=2, seed=3)
    off = generate(make_engine(tiny_llama_dir, **SMALL_POOL), prompts, "r")
    cfg = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path), **SMALL_POOL}
    first = make_engine(tiny_llama_dir, **cfg)
    generate(first, prompts, "a")
    first.runner.host_kv.disk.flush()          # as a graceful shutdown does
    engine = make_engine(tiny_llama_dir, **cfg)
    if l3_mode is not None:
        engine.runner.host_kv.disk.fetch_limit = L3Fault.armed(l3_mode)
    assert_same(off, generate(engine, prompts, "b"))
    stats = engine.stats()
    assert stats["hicache_disk_fetches"] > 0
    if l3_mode == "fail":
        assert stats["hicache_disk_fetch_pages"] == 0 and stats["num_cached_tokens_host"] == 0
    else:
        assert stats["hicache_disk_fetch_pages"] > 0 and stats["num_cached_tokens_host"] > 0
    engine.check_invariants()
