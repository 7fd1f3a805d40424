"""--pp-size: refused combinations, the micro-batch split, and one stage's layers, parameters and KV (no group)."""
from __future__ import annotations

import pytest

from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.models.registry import model_class
from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.runner.pp import PPModelRunner, split_micro_batches
from radixserve.weights.safetensors import read_hf_config
from tests.conftest import build_tiny_llama
from tests.model.test_families import DSA_SHARED, build_family


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp_size=0), "positive"),
    (dict(pp_size=2, pp_micro_batches=0), "positive"),
    (dict(pp_micro_batches=2), "--pp-micro-batches needs --pp-size > 1"),
    (dict(pp_size=3, nnodes=2, dist_init_addr="h:1"), "--nnodes must divide the 3 ranks"),
    (dict(pp_size=2, cp_size=2), "--pp-size 2 cannot be combined with --cp-size > 1"),
    (dict(pp_size=2, tp_size=2, cp_size=2), "--cp-size > 1"),
    (dict(pp_size=2, tp_size=4, ep_size=3), "--ep-size 3 must be a positive divisor of --tp-size 4"),
    (dict(pp_size=2, tp_size=2, speculative_algorithm="draft", speculative_draft_layers=1), "draft"),
    (dict(pp_size=2, tp_size=2, kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(pp_size=3, tp_size=2, nnodes=4, dist_init_addr="h:1"), "--nnodes must divide the 6 ranks"),
    (dict(pp_size=2, speculative_algorithm="ngram"), "--speculative-algorithm ngram"),
    (dict(pp_size=2, speculative_algorithm="draft", speculative_draft_layers=1), "--speculative-algorithm draft"),
    (dict(pp_size=2, speculative_algorithm="EAGLE"), "--speculative-algorithm EAGLE"),
    (dict(pp_size=2, disaggregation_mode="decode"), "--disaggregation-mode"),
    (dict(pp_size=2, enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(pp_size=2, kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(pp_size=2, enable_deterministic_inference=True), "--enable-deterministic-inference"),
    (dict(pp_size=2, enable_kv_checksum=True), "--enable-kv-checksum"),
    (dict(pp_size=2, compile="on"), "--compile on"),
    (dict(pp_size=2, quantization="int4-fp32"), "--quantization int4-fp32"),
    (dict(pp_size=2, quantization="int4"), "--quantization int4"),
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_accepted():
    c = EngineConfig(pp_size=4, pp_micro_batches=8, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert (c.world_size, c.pp_micro_batches) == (4, 8)
    assert EngineConfig(pp_size=2).pp_micro_batches is None
    assert EngineConfig(pp_size=2, compile="auto").compile_mode == "auto"   # auto decodes eagerly under PP
    both = EngineConfig(pp_size=2, tp_size=4, ep_size=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert both.world_size == 8


def test_micro_batches_are_consecutive_sequences_of_near_equal_count():
    batch = list("abcdefg")
    assert split_micro_batches(batch, 3) == [list("abc"), list("de"), list("fg")]
    assert split_micro_batches(batch, 1) == [batch]
    assert split_micro_batches(list("ab"), 4) == [["a"], ["b"]]          # never an empty micro-batch


class Rank:
    """The part of a Communicator a stage reads while it loads (it makes no collective then)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_more_stages_than_layers_and_an_indivisible_residual_are_refused(tmp_path):
    llama = ModelConfig.from_hf(read_hf_config(build_tiny_llama(tmp_path / "llama")))
    with pytest.raises(ValueError, match="--pp-size 3 exceeds the model's 2 layers"):
        PPModelRunner.select_part(model_class(llama)(llama), [], comm=Rank(0, 3))
    with pytest.raises(ValueError, match="--pp-size 3 exceeds the model's 2 layers"):
        PPModelRunner.select_part(model_class(llama)(llama), [], comm=Rank(5, 6), tp=Rank(1, 2))
    with pytest.raises(ValueError, match="--tp-size 3: the hidden size 64 does not divide"):
        PPModelRunner.select_part(model_class(llama)(llama), [], comm=Rank(0, 6), tp=Rank(0, 3))


def test_dsa_stages_hold_their_latent_and_index_keys(tmp_path):
    """glm_moe_dsa, 5 layers (full, full, shared, shared, full) on 3 stages [0, 2), [2, 4), [4, 5): each stage's
    latent KV has its layers, index keys only in its full layers renumbered ((0, 1), none, (0,)) as its indexers are;
    the pages equal everywhere, sized for the stage of most bytes per token; stage 1 starts on a shared layer, so
    stage 0 sends it the top-k."""
    folder = str(build_family(tmp_path / "dsa", "glm_moe_dsa", spec=DSA_SHARED))
    config = EngineConfig(model_path=folder, pp_size=3, quantization="none", num_threads=1, kv_cache_memory_gb=0.001)
    stages = [PPModelRunner.from_config(config, comm=Rank(s, 3)) for s in range(3)]
    assert [r.kv.num_layers for r in stages] == [2, 2, 1]
    assert [r.kv.side_layers(INDEX_KEYS) if r.kv.side_names else None for r in stages] == [[0, 1], None, [0]]
    layers = [stages[0].model.model.layers[1], stages[2].model.model.layers[4]]
    assert [(x.self_attn.layer_id, x.self_attn.indexer.layer_id) for x in layers] == [(1, 1), (0, 0)]
    assert [(r.receives_topk, r.sends_topk) for r in stages] == [(False, True), (True, False), (False, False)]
    mc = stages[0].model_config
    latent, index = 4 * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim), 4 * mc.dsa.index_head_dim
    per_token = [2 * latent + 2 * index, 2 * latent, latent + index]
    size = config.page_size
    pages = int(0.001 * 2**30) // (size * max(per_token))
    assert [r.num_pages for r in stages] == [pages] * 3
    assert [r.kv.allocated_bytes() for r in stages] == [pages * size * b for b in per_token]


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_holds_only_its_layers_and_their_kv(tmp_path, tied):
    """A 5-layer Llama on 3 stages: layers [0, 2), [2, 4), [4, 5); stage 0 the embedding, the last the norm and
    head (tied: the embedding as its storage); each stage's KV has its layers only, the pages equal everywhere."""
    folder = str(build_tiny_llama(tmp_path / "m", num_hidden_layers=5, tie_word_embeddings=tied))
    config = EngineConfig(model_path=folder, pp_size=3, quantization="none", num_threads=1,
                          kv_cache_memory_gb=0.001)
    stages = [PPModelRunner.from_config(config, comm=Rank(s, 3)) for s in range(3)]
    names = [{n.split(".weight")[0] for n, _ in r.model.named_parameters()} for r in stages]
    layers = [sorted({int(n.split(".")[2]) for n in ns if n.startswith("model.layers.")}) for ns in names]
    assert layers == [[0, 1], [2, 3], [4]]
    assert ["model.embed_tokens" in ns for ns in names] == [True, False, tied]
    assert ["model.norm" in ns for ns in names] == [False, False, True]
    assert ["lm_head" in ns for ns in names] == [False, False, not tied]
    assert [r.model.model.layers[2].self_attn.layer_id for r in stages[1:2]] == [0]
    assert [r.kv.num_layers for r in stages] == [2, 2, 1]
    assert len({r.num_pages for r in stages}) == 1
    token = 2 * stages[0].kv.num_kv_heads * stages[0].kv.head_dim * 4
    assert [r.kv.allocated_bytes() for r in stages] == [n * stages[0].num_pages * config.page_size * token
                                                         for n in (2, 2, 1)]
