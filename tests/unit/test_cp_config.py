"""--cp-size and --enable-layer-split: refused combinations, LayerSplit ownership, and a rank's KV bytes (no group)."""
from __future__ import annotations

import pytest

from radixserve.engine_config import EngineConfig
from radixserve.runner.cp import CPModelRunner
from radixserve.runner.layer_split import owned_layers
from tests.conftest import build_tiny_llama
from tests.model.test_families import build_family


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_size=3, nnodes=2, dist_init_addr="h:1"), "--nnodes must divide the 3 ranks"),
    (dict(cp_size=0), "positive"),
    (dict(enable_layer_split=True), "--enable-layer-split needs --cp-size > 1"),
    (dict(cp_size=2, tp_size=2), "not built yet"),
    (dict(cp_size=2, enable_layer_split=True, enable_kv_checksum=True), "--enable-kv-checksum"),
    (dict(cp_size=2, disaggregation_mode="decode"), "--disaggregation-mode decode with --tp-size 1 --cp-size 2 is not"),
    (dict(cp_size=2, enable_layer_split=True, disaggregation_mode="decode"),
     "--disaggregation-mode decode with --tp-size 1 --cp-size 2 --enable-layer-split is not built"),
    (dict(cp_size=2, enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(cp_size=2, speculative_algorithm="ngram"), "--speculative-algorithm ngram"),
    (dict(cp_size=2, kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(cp_size=2, enable_deterministic_inference=True), "--enable-deterministic-inference"),
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_accepted():
    c = EngineConfig(cp_size=4, enable_layer_split=True, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert (c.world_size, c.enable_layer_split) == (4, True)
    assert EngineConfig(tp_size=2, speculative_algorithm="ngram").world_size == 2
    for prefill in (dict(cp_size=2), dict(cp_size=2, enable_layer_split=True), dict(tp_size=2)):   # C58
        assert EngineConfig(**prefill, disaggregation_mode="prefill").world_size == 2


def test_owned_layers_are_contiguous_and_cover_every_layer_once():
    assert [owned_layers(78, 4, r) for r in range(4)] == [range(0, 20), range(20, 40), range(40, 59), range(59, 78)]
    for num_layers in (2, 3, 5):
        ranges = [owned_layers(num_layers, 2, r) for r in range(2)]
        assert [layer for rng in ranges for layer in rng] == list(range(num_layers))
        assert [len(rng) for rng in ranges] == [-(-num_layers // 2), num_layers // 2]


class Rank:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("num_layers", [2, 3, 5])
def test_layer_split_kv_bytes_per_rank(tmp_path, num_layers):
    """S1 = (n_r + 1) * S * 2 * KV * D * 4 on each of 2 ranks, S0 = L * S * 2 * KV * D * 4 without LayerSplit."""
    build_tiny_llama(tmp_path, num_hidden_layers=num_layers)
    config = EngineConfig(model_path=str(tmp_path), cp_size=2, max_total_tokens=1024, quantization="none",
                          num_threads=1)
    token = 2 * 2 * 16 * 4            # K and V, 2 KV heads of dim 16, fp32
    plain = CPModelRunner.from_config(config, comm=Rank(0, 2))
    assert plain.kv.allocated_bytes() == num_layers * 1024 * token
    split = EngineConfig(**{**config.__dict__, "enable_layer_split": True})
    for rank in range(2):
        runner = CPModelRunner.from_config(split, comm=Rank(rank, 2))
        n_r = num_layers // 2 + (rank < num_layers % 2)
        assert runner.kv.allocated_bytes() == (n_r + 1) * 1024 * token


def test_layer_split_keeps_index_keys_in_its_full_layers_and_the_scratch(tmp_path):
    """glm_moe_dsa with layers full, shared, full on 2 ranks: rank 0 (layers 0-1, scratch 2) stores index keys in
    storage 0 (layer 0) and the scratch (layer 2's broadcast); rank 1 (layer 2 as 0, scratch 1) in 0 and the scratch."""
    from radixserve.runner.attention.sparse import INDEX_KEYS
    from tests.model.test_families import FAMILIES

    config_cls, model_cls, extra = FAMILIES["glm_moe_dsa"]
    build_family(tmp_path, "", spec=(config_cls, model_cls, {**extra, "indexer_types": ["full", "shared", "full"]}))
    config = EngineConfig(model_path=str(tmp_path), cp_size=2, enable_layer_split=True, max_total_tokens=1024,
                          quantization="none", num_threads=1)
    for rank, layers in [(0, [0, 2]), (1, [0, 1])]:
        runner = CPModelRunner.from_config(config, comm=Rank(rank, 2))
        assert runner.model.config.dsa.full_layers == (0, 2)
        assert runner.kv.side_layers(INDEX_KEYS) == layers
