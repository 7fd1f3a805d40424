"""EAGLE / NEXTN with the MTP layer of glm_moe_dsa (GLM-5) and deepseek_v32 (issue 41 item 2; cases C51-C53).

A tiny random glm_moe_dsa (IndexShare pattern F S F, index_topk 8, 16 indexer heads) with one MTP layer in GLM's
on-disk layout, built from transformers' own GlmMoeDsaForCausalLM and MtpModel (tests/model/mtp_checkpoint.py
dsa_mtp_model). The draft is a full DSA layer: its index keys are layer 3 of the cache's index-key side buffer, next to
the target's full layers 0 and 2. Every draft equals transformers' MTP chain (its sparse attention over the top-8 once
the draft context passes 8 tokens) under the glm4_moe test's scenarios, run by its own helpers: batching, a warm cache,
small chunks, preemption, shared-prefix radix hits, host-tier reloads and PD; greedy output equals the output without
speculation; a draft built to be accepted extends its KV over accepted tokens as transformers' chain does; missing
indexer weights of the MTP layer fail the load (C53). deepseek_v32 (DeepSeek-V3.2: every layer full, its MTP layer's
index keys at layer 3 next to the target's 0-2) runs a subset: drafts in two scenarios and after a shared prefix, greedy
output, C53."""
from __future__ import annotations

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.runner.kv_sizing import num_pages
from tests.model.mtp_checkpoint import build_glm_mtp
from tests.model.test_mtp import (EAGLE, check_drafts_after_a_shared_prefix, check_drafts_after_host_tier_reloads,
                                  check_drafts_in_scenario, check_greedy_equals_no_speculation,
                                  check_pd_decode_drafts, rewrite, runner)
from tests.model.test_parity import SCENARIOS

DSA = {"family": "glm_moe_dsa", "num_nextn_predict_layers": 1, "index_topk_pattern": "FSF"}
V32 = {"family": "deepseek_v32", "num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def dsa_mtp_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm5_mtp")
    model, mtp = build_glm_mtp(folder, **DSA)
    assert mtp.layers[0].mtp_block.self_attn.indexer is not None and model.config.index_topk == 8
    return folder, model, mtp


@pytest.fixture(scope="module")
def accepting_case(tmp_path_factory):
    """The exact build (target and draft predict the next token from the current one) with the draft's attention
    output given back (o_proj random, x 0.1): drafts are mostly accepted and still depend on the draft's sparse
    attention (a dense draft differs from transformers' by 5e-3), so the extend over accepted rows is checked."""
    folder = tmp_path_factory.mktemp("glm5_mtp_accepting")
    model, mtp = build_glm_mtp(folder, exact=True, **DSA)
    gen = torch.Generator().manual_seed(3)
    weight = mtp.layers[0].mtp_block.self_attn.o_proj.weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=gen) * 0.1)
    rewrite(folder, lambda t: t.__setitem__("model.layers.3.self_attn.o_proj.weight", weight.detach().clone()))
    return folder, model, mtp


def test_accepted_drafts_extend_the_draft_kv_as_transformers(accepting_case):
    engine = check_drafts_in_scenario(accepting_case, "d_small_chunks")
    s = engine.stats()
    assert s["spec_num_accepted_tokens"] > s["spec_num_verify_steps"], s
    check_greedy_equals_no_speculation(accepting_case[0], "e_preemption", exact=True)


@pytest.mark.parametrize("name", ["b_all_at_once", "c_warm_cache", "d_small_chunks", "e_preemption"])
def test_drafts_equal_transformers_mtp(dsa_mtp_case, name):
    check_drafts_in_scenario(dsa_mtp_case, name)


def test_drafts_equal_transformers_mtp_after_a_shared_prefix(dsa_mtp_case):
    """C51: radix hits reuse the draft's latent and index keys of the shared pages."""
    check_drafts_after_a_shared_prefix(dsa_mtp_case, 16)


def test_drafts_equal_transformers_mtp_after_host_tier_reloads(dsa_mtp_case):
    """C51: the draft's index keys travel to the host tier and back with the rest of the page."""
    check_drafts_after_host_tier_reloads(dsa_mtp_case)


def test_pd_decode_drafts_from_the_transferred_draft_kv(dsa_mtp_case):
    """C52: the prefill side sends the draft's latent and index keys with the target's."""
    check_pd_decode_drafts(dsa_mtp_case)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_equals_no_speculation(dsa_mtp_case, name):
    check_greedy_equals_no_speculation(dsa_mtp_case[0], name)


@torch.inference_mode()
def test_the_draft_layer_owns_index_keys_in_the_one_cache(dsa_mtp_case):
    """Index keys in the target's full layers and the draft's layer 3, sized into the pool; the kv_corrupt fault changes
    the target's index keys and leaves the draft's alone (the draft's KV is written by the draft only)."""
    folder = dsa_mtp_case[0]
    r = runner(folder)
    mc, kv = r.model_config, r.kv
    assert kv.num_layers == 4 and kv.side_layers(INDEX_KEYS) == [0, 2, 3]
    per_token = 4 * (4 * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim) + 3 * mc.dsa.index_head_dim)
    assert kv.slot_bytes == per_token
    sized = EngineConfig(model_path=str(folder), kv_cache_memory_gb=0.001, **EAGLE)
    assert num_pages(sized, mc, num_layers=4) == int(0.001 * 2**30) // (per_token * sized.page_size)
    for layer in (0, 2, 3):
        kv.write_side(INDEX_KEYS, layer, torch.arange(64), torch.randn(64, mc.dsa.index_head_dim))
    before = kv.export_pages([0]).side[INDEX_KEYS]
    r.corrupt_kv([0], "swap", [2], seed=1)
    after = kv.export_pages([0]).side[INDEX_KEYS]
    assert not torch.equal(before[:2], after[:2]) and torch.equal(before[2], after[2])


def test_missing_indexer_weights_of_the_mtp_layer_fail_the_load(tmp_path):
    """C53: the MTP layer's indexer is its own (never the target's, never left at its initial weights)."""
    build_glm_mtp(tmp_path, **DSA)
    rewrite(tmp_path, lambda t: t.pop("model.layers.3.self_attn.indexer.wk.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.\*: checkpoint lacks .*self_attn\.indexer\.wk\.weight"):
        runner(tmp_path)


@pytest.fixture(scope="module")
def v32_mtp_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv32_mtp")
    model, mtp = build_glm_mtp(folder, **V32)
    assert mtp.layers[0].mtp_block.self_attn.indexer is not None
    kv = runner(folder).kv
    assert kv.side_layers(INDEX_KEYS) == [0, 1, 2, 3] and kv.slot_bytes == 4 * 4 * ((32 + 8) + 32)   # fp32, 4 layers
    return folder, model, mtp


@pytest.mark.parametrize("name", ["b_all_at_once", "e_preemption"])
def test_deepseek_v32_drafts_equal_transformers_mtp(v32_mtp_case, name):
    check_drafts_in_scenario(v32_mtp_case, name)


def test_deepseek_v32_drafts_equal_transformers_mtp_after_a_shared_prefix(v32_mtp_case):
    check_drafts_after_a_shared_prefix(v32_mtp_case, 16)


def test_deepseek_v32_greedy_equals_no_speculation(v32_mtp_case):
    check_greedy_equals_no_speculation(v32_mtp_case[0], "d_small_chunks")


def test_deepseek_v32_missing_mtp_weights_fail_the_load(tmp_path):
    build_glm_mtp(tmp_path, **V32)
    rewrite(tmp_path, lambda t: t.pop("model.layers.3.self_attn.indexer.weights_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.\*: checkpoint lacks .*indexer\.weights_proj\.weight"):
        runner(tmp_path)
    rewrite(tmp_path, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.3.")]])
    with pytest.raises(ValueError, match="no NextN"):
        runner(tmp_path)


@torch.inference_mode()
def test_kv_checksums_cover_the_targets_layers_only(dsa_mtp_case):
    """--enable-kv-checksum re-checks the target's KV; the draft rewrites its own layer (the last) by design, so a
    change there is not a corruption (it ended a normal EAGLE request as kv_checksum before)."""
    r = runner(dsa_mtp_case[0])
    slots = list(range(r.page_size))
    before = r.kv_slot_checksums(slots)
    data = r.kv.export_pages([0])
    data.k[-1] += 1.0
    r.kv.import_pages([0], data)
    assert r.kv_slot_checksums(slots) == before
    data.k[0] += 1.0
    r.kv.import_pages([0], data)
    assert r.kv_slot_checksums(slots) != before
