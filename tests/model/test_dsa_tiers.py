"""GLM-5's index keys through the KV tiers and PD (runner/attention/sparse.py): the host and disk tiers and the PD
bytes carry latent and index keys together, and GLM-5's race reproduces on demand: with the hicache.h2d.layer fault's
skip_wait "side" (index-key reads stop waiting for the layer's host load) and delayed loads, outputs differ from the
tier-off run; with the wait on, under the same delays, they are equal."""
from __future__ import annotations

import pytest
import torch

from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.runner.kv_cache import KVPages
from radixserve.runner.kv_transfer import pack_pages, unpack_pages
from tests.model.test_dsa import build_dsa
from tests.model.test_hicache_model import SMALL_POOL, assert_same, generate, rounds, sessions
from tests.model.test_parity import faults_of, make_engine


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory):
    return build_dsa(tmp_path_factory.mktemp("dsa"), num_hidden_layers=6, index_topk_freq=4)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_reloads_latent_and_index_keys(dsa_dir, policy):
    prompts = sessions()
    off = rounds(make_engine(dsa_dir, **SMALL_POOL), prompts)
    engine = make_engine(dsa_dir, enable_hierarchical_cache=True, hicache_write_policy=policy, **SMALL_POOL)
    on = rounds(engine, prompts)
    for a, b in zip(off, on):
        assert_same(a, b)
    stats, kv = engine.stats(), engine.runner.kv
    assert stats["hicache_loads"] > 0 and stats["hicache_failed_loads"] == 0
    assert engine.runner.host_kv.page_bytes == kv.slot_bytes * 16 and kv.slot_bytes > kv.token_bytes
    engine.check_invariants()


def test_disk_tier_restart_reads_latent_and_index_keys_back(dsa_dir, tmp_path):
    prompts = sessions(n=2, seed=3)
    off = generate(make_engine(dsa_dir, **SMALL_POOL), prompts, "r")
    cfg = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path), **SMALL_POOL}
    first = make_engine(dsa_dir, **cfg)
    generate(first, prompts, "a")
    first.runner.host_kv.disk.flush()
    engine = make_engine(dsa_dir, **cfg)
    assert_same(off, generate(engine, prompts, "b"))
    assert engine.stats()["hicache_disk_fetch_pages"] > 0


def test_pd_bytes_carry_latent_and_index_keys(dsa_dir):
    """export -> bytes -> import into another worker's pages: the same latent and index keys, full layers only."""
    runner = make_engine(dsa_dir, **SMALL_POOL).runner
    kv, pages = runner.kv, list(range(4))
    for layer in range(kv.num_layers):
        k = torch.randn(64, 1, kv.head_dim)
        kv.write(layer, torch.arange(64), k, k)
    for layer in kv.side_layers(INDEX_KEYS):
        kv.write_side(INDEX_KEYS, layer, torch.arange(64), torch.randn(64, runner.model_config.dsa.index_head_dim))
    data = runner.export_kv(pages)
    assert len(data) == kv.slot_bytes * 16 * len(pages)
    other = make_engine(dsa_dir, **SMALL_POOL).runner
    other.import_kv([9, 3, 5, 1], data, foreign=True)
    mine, theirs = kv.export_pages(pages), other.kv.export_pages([9, 3, 5, 1])
    assert torch.equal(mine.k, theirs.k) and torch.equal(mine.side[INDEX_KEYS], theirs.side[INDEX_KEYS])
    assert mine.side[INDEX_KEYS].shape[0] == 3 and mine.side[INDEX_KEYS].abs().sum() > 0
    assert torch.equal(unpack_pages(other.kv, 4, pack_pages(theirs)).side[INDEX_KEYS], mine.side[INDEX_KEYS])


def poison_free_index_keys(engine) -> None:
    """Overwrite every free device page's index keys with noise, so an early read cannot see old keys."""
    kv, free = engine.runner.kv, engine.kv.pool.free_ids()
    data = kv.export_pages(free)
    gen = torch.Generator().manual_seed(0)
    side = {name: torch.randn(t.shape, generator=gen).to(t.dtype) * 10 for name, t in data.side.items()}
    kv.import_pages(free, KVPages(data.k, data.v, side))


def reload_under_delays(dsa_dir, skip_wait: str):
    """Serve A, push it to host, poison the free pages' index keys, serve A again with every layer's load delayed
    and the readiness wait as `skip_wait` says; the (token, logprob) pairs of the second run."""
    engine = make_engine(dsa_dir, faults=True, enable_hierarchical_cache=True, **SMALL_POOL)
    a, *noise = sessions(n=3, seed=2)
    generate(engine, [a], "a")
    generate(engine, noise, "n")
    assert not engine.kv.cache.match(a).page_ids and engine.kv.cache.match(a).host_path
    poison_free_index_keys(engine)
    faults_of(engine).fault("hicache.h2d.layer", latency_ms=150, skip_wait=skip_wait)
    out = generate(engine, [a], "b")[0]
    faults_of(engine).fault("hicache.h2d.layer", clear=True)
    assert not engine.runner.kv.skip_side_readiness_wait
    assert engine.stats()["num_cached_tokens_host"] > 0
    engine.check_invariants()
    return out


def test_glm5_race_index_keys_read_before_their_load(dsa_dir):
    reference = generate(make_engine(dsa_dir, **SMALL_POOL), sessions(n=1, seed=2), "r")[0]
    assert_same({0: reference}, {0: reload_under_delays(dsa_dir, "none")})
    raced = reload_under_delays(dsa_dir, "side")
    assert abs(raced[0][1] - reference[0][1]) > 1e-3, "index keys read before their load went unnoticed"


def load_soak():
    """benchmarks/dsa_race_soak.py as a module (its CI-sized run)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "dsa_race_soak.py"
    spec = importlib.util.spec_from_file_location("dsa_race_soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_race_soak_with_the_wait_has_no_differing_output(tmp_path):
    """The soak of issue 40 at CI size: 300 requests through a 24-page device pool and the host tier, every layer's
    load delayed 0-2 ms: 0 differing outputs with the wait; with skip_wait "side" the same run differs."""
    soak = load_soak()
    folder = soak.build_tiny(str(tmp_path))
    waited = soak.soak(folder, num_requests=300)
    assert waited["differing"] == 0 and waited["hicache_loads"] > 50 and waited["cached_tokens_host"] > 0, waited
    raced = soak.soak(folder, num_requests=100, skip_wait="side")
    assert raced["differing"] > 0, raced


def test_pd_parity_with_colocated_carries_both_parts(dsa_dir):
    """PD (prefill worker -> decode worker, the abort/ack handshake of docs/disagg) on the DSA model: prompts of 1 to
    33 tokens (index_topk 8: both sides of the boundary) and a prefill-side prefix hit decode what colocated serving
    decodes, so the decode side read the latent and the index keys the prefill side wrote."""
    from tests.model.test_pd_race import check_pd_parity_with_colocated

    check_pd_parity_with_colocated(dsa_dir)


def test_skip_wait_is_validated_at_the_http_boundary():
    from pydantic import ValidationError

    from radixserve.chaos.http_faults import FaultSpec
    from radixserve.errors import InvalidRequest

    assert FaultSpec(kind="hicache.h2d.layer", latency_ms=1, skip_wait="side").params()["skip_wait"] == "side"
    with pytest.raises(ValidationError):
        FaultSpec(kind="hicache.h2d.layer", latency_ms=1, skip_wait="index")
    with pytest.raises(InvalidRequest, match="takes no 'skip_wait'"):
        FaultSpec(kind="hicache.d2h", latency_ms=1, skip_wait="all").params()
