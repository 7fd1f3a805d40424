"""MLA and DSA under tensor parallelism (C47): TP=2 and TP=4 over gloo vs TP=1 on the tiny glm4_moe_lite, glm_moe_dsa
and deepseek_v32 configs (tests/model/tp_worker.py and test_tp.py's checks).

Prompts of 3 to 100 tokens (up to 7 pages of 16, past index_topk 8, so the indexer selects) and a follow-up that
hits the radix cache on 5 of the long prompt's pages. Checked: logits within 1e-5 relative and greedy tokens equal;
every rank's logits and every indexer top-k bit-identical; each rank's stored KV (latent and index keys) of the long
and the follow-up request bit-identical across ranks and within 1e-5 of TP=1's; KV pool bytes and tokens per rank
equal TP=1's (replicated, never divided along pages); per-rank parameter and collective bytes equal
docs/parallel.md's formulas exactly."""
from __future__ import annotations

import pytest
import torch

from radixserve.models.model_config import ModelConfig
from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.weights.safetensors import read_hf_config
from tests.model.test_families import build_family
from tests.model.test_tp import assert_collective_bytes, assert_export, assert_matches_tp1, param_bytes, run_group
from tests.model.tp_worker import FOLLOW_UP, PROMPTS

GROUPS = {2: ("glm4_moe_lite", "glm_moe_dsa", "deepseek_v32"), 4: ("glm_moe_dsa",)}
CASES = [(tp, i) for tp, cases in GROUPS.items() for i in range(len(cases))]
IDS = [f"tp{tp}-{GROUPS[tp][i]}" for tp, i in CASES]
MAX_TOTAL_TOKENS = 4096     # tp_worker's, at every TP size


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """tp -> (configs, each rank's results), one group per TP size."""
    out = {}
    for tp, cases in GROUPS.items():
        folders = [str(build_family(tmp_path_factory.mktemp(case), case)) for case in cases]
        configs = [ModelConfig.from_hf(read_hf_config(f)) for f in folders]
        out[tp] = (configs, run_group(tmp_path_factory.mktemp(f"tp{tp}-out"), folders, tp_size=tp))
    return out


def case(groups, tp: int, index: int) -> tuple[ModelConfig, list[dict]]:
    configs, ranks = groups[tp]
    return configs[index], [r[index] for r in ranks]


@pytest.mark.parametrize("tp,index", CASES, ids=IDS)
def test_logits_and_greedy_tokens_equal_tp1(groups, tp, index):
    _, ranks = case(groups, tp, index)
    assert_matches_tp1(ranks[0])
    assert set(ranks[0]["tokens"]) == {str(i) for i in range(len(PROMPTS) + 1)} | {"f0"}


@pytest.mark.parametrize("tp,index", CASES, ids=IDS)
def test_every_rank_bit_identical_logits_and_top_k(groups, tp, index):
    config, ranks = case(groups, tp, index)
    for other in ranks[1:]:
        assert len(other["steps"]) == len(ranks[0]["steps"])
        for a, b in zip(ranks[0]["steps"], other["steps"]):
            assert torch.equal(a["logits"], b["logits"])
        assert len(other["topk"]) == len(ranks[0]["topk"])
        for a, b in zip(ranks[0]["topk"], other["topk"]):
            assert (a is None) == (b is None)
            for x, y in zip(a or (), b or ()):
                assert (x is None and y is None) or torch.equal(x, y)
    if config.dsa is not None:     # the indexer really chose: some rows kept index_topk of a longer context
        chosen = [s for out in ranks[0]["topk"] if out for s in out if s is not None]
        assert chosen and all(s.shape[1] == config.dsa.index_topk for s in chosen)
    else:
        assert ranks[0]["topk"] == []


def pool_bytes(config: ModelConfig, tokens: int) -> int:
    """docs/parallel.md: a rank's fp32 KV pool at any TP size, TP=1's: every layer's latent (kv_lora_rank + rope) and
    every full DSA layer's index key (index_head_dim), per token slot."""
    per_token = config.num_layers * (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)
    if config.dsa is not None:
        per_token += len(config.dsa.full_layers) * config.dsa.index_head_dim
    return 4 * tokens * per_token


@pytest.mark.parametrize("tp,index", CASES, ids=IDS)
def test_latent_pool_replicated_on_every_rank(groups, tp, index):
    config, ranks = case(groups, tp, index)
    ref = ranks[0]["ref_kv"]
    long_id = str(len(PROMPTS))
    first = [s["start"]["f0"] for s in ranks[0]["steps"] if "f0" in s["start"]][0]
    assert first == len(FOLLOW_UP[0]) // 16 * 16 == 80      # the prefix hit: 5 cached pages
    for rank in ranks:
        kv = rank["kv"]
        assert kv["num_pages"] * kv["page_size"] == ref["num_pages"] * ref["page_size"] == MAX_TOTAL_TOKENS
        assert kv["allocated_bytes"] == ref["allocated_bytes"] == pool_bytes(config, MAX_TOTAL_TOKENS)
        assert kv["pages"] == ranks[0]["kv"]["pages"]
        assert kv["pages"]["f0"][:5] == kv["pages"][long_id][:5]
        for rid, (k, v, side) in kv["stored"].items():
            k0, _, side0 = ranks[0]["kv"]["stored"][rid]
            assert k.shape == (config.num_layers, 1, len(kv["pages"][rid]), 16,
                               config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)
            assert v.shape[1] == 0 and k.abs().amax() > 0
            assert torch.equal(k, k0) and side.keys() == side0.keys()
            assert all(torch.equal(side[name], side0[name]) for name in side)
            ref_k, _, ref_side = ref["stored"][rid]
            assert float((k - ref_k).abs().max() / ref_k.abs().max()) <= 1e-5
            assert side.keys() == ref_side.keys() == ({INDEX_KEYS} if config.dsa else set())
            for name in side:
                assert float((side[name] - ref_side[name]).abs().max() / ref_side[name].abs().max()) <= 1e-5


@pytest.mark.parametrize("tp,index", CASES, ids=IDS)
def test_parameter_and_collective_bytes_equal_the_formulas(groups, tp, index):
    config, ranks = case(groups, tp, index)
    for rank in ranks:
        assert rank["param_bytes"] == param_bytes(config, tp)
        assert_collective_bytes(config, rank["steps"], tp)
    assert param_bytes(config, 1) < tp * ranks[0]["param_bytes"]     # replicated LoRA down-projections, indexer


@pytest.mark.parametrize("tp,index", CASES, ids=IDS)
def test_pd_export_is_rank_0s_own_latent(groups, tp, index):
    config, ranks = case(groups, tp, index)
    assert_export(config, ranks[0], tp)
