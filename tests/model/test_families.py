"""Qwen3, Qwen3-MoE, GLM-4 (glm), GLM-4-0414 (glm4), GLM-4.5 (glm4_moe), GLM-4.7-Flash (glm4_moe_lite, MLA) and
GLM-5 (glm_moe_dsa, MLA + DSA) against transformers.

Tiny random-weight configs (router weights and the GLM
correction bias randomised: transformers initialises them to zero, which makes every expert
tie). Engine level: the five scheduling scenarios of test_parity.py, greedy token for token
(tie rule). Runner level: a mixed decode/prefill/cached-prefix batch, top-5 logprobs within
1e-4. Prompt lengths straddle the partial-rotary and chunk boundaries of case C42. The MLA config's cache
head (kv_lora_rank + rope = 40) differs from its q.k width (nope + rope = 24) and its v_head_dim (12), so the
softmax scale and the value split are exercised. The DSA config keeps 16 indexer heads (fewer make index-score ties
flip the top-k with chunking, glm-archs §0) and index_topk 8, so prompts of 1 and 7 tokens decode across the
dense/sparse boundary and every batch mixes dense and sparse sequences (C49); tests/model/test_dsa.py has the rest.
"""
from __future__ import annotations

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.weights.safetensors import read_hf_config
from tests.model.parity import hf_greedy_batch
from tests.model.test_parity import SCENARIOS, NUM_NEW, prompt_set, run_scenario
from tests.model.test_runner import Harness, mixed_batch_scenario

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
MOE = dict(num_hidden_layers=3, intermediate_size=128, num_key_value_heads=2, moe_intermediate_size=32,
           num_experts_per_tok=2)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        MOE, head_dim=32, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        rope_theta=1e6)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        MOE, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=1.8, rope_theta=1e6)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        MOE, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=1.8, rope_theta=1e6,
        first_k_dense_replace=1, index_n_heads=16, index_head_dim=32, index_topk=8)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        MOE, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        routed_scaling_factor=1.8, first_k_dense_replace=1, index_n_heads=16, index_head_dim=32, index_topk=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        MOE, head_dim=16, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0])),
}
# glm_moe_dsa on 5 layers, IndexShare layers 2 and 3 (a pipeline stage may start on one: tests/model/test_pp.py)
DSA_SHARED = (*FAMILIES["glm_moe_dsa"][:2], {**FAMILIES["glm_moe_dsa"][2], "num_hidden_layers": 5,
                                             "indexer_types": ["full", "full", "shared", "shared", "full"]})
LENGTHS = [1, 7, 23, 24, 25, 63, 64, 65, 129, 300]


def build_family(folder, family: str, seed: int = 0, spec: tuple[str, str, dict] | None = None):
    """Save the tiny random checkpoint of `family` (FAMILIES, or `spec` = (config class, model
    class, config kwargs over COMMON)) into folder."""
    import transformers

    config_cls, model_cls, extra = spec or FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn_like(tensor) * 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand_like(tensor) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_family(tmp_path_factory.mktemp(request.param), request.param)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = prompt_set(hf.config.vocab_size, 1, LENGTHS)
    return request.param, folder, prompts, hf_greedy_batch(hf, prompts, NUM_NEW)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_family_engine_parity(family_case, scenario):
    _, folder, prompts, refs = family_case
    run_scenario(folder, prompts, refs, scenario)


def test_family_runner_logprobs_in_a_mixed_batch(family_case):
    mixed_batch_scenario(Harness(family_case[1], 16, seed=5), decodes_first=True, mixed_steps=3)


def test_family_config_is_normalised(family_case):
    family, folder = family_case[0], family_case[1]
    mc = ModelConfig.from_hf(read_hf_config(str(folder)))
    assert mc.architecture == family
    glm = family in ("glm", "glm4", "glm4_moe")
    assert mc.rot_dim == (mc.head_dim // 2 if glm else mc.head_dim)
    mla = family in ("glm4_moe_lite", "glm_moe_dsa", "deepseek_v32")
    assert mc.rope_interleaved == (family in ("glm", "glm4") or mla) and mc.post_norms == (family == "glm4")
    assert mc.qk_norm == (family in ("qwen3", "qwen3_moe", "glm4_moe"))
    assert (mc.moe is not None) == ("_moe" in family or family == "deepseek_v32")
    if glm:
        assert mc.qkv_bias and not mc.o_bias
    assert (mc.dsa is not None) == (family in ("glm_moe_dsa", "deepseek_v32"))
    if mc.dsa is not None:
        assert mc.dsa.index_rope_interleaved == (family == "glm_moe_dsa")
    if mla:
        assert mc.mla is not None and mc.moe.dense_layers == (0,) and mc.head_dim == mc.mla.qk_rope_head_dim == 8
        assert tuple(mc.kv_shape) == (1, 32 + 8, True)
    else:
        assert mc.mla is None and tuple(mc.kv_shape) == (mc.num_kv_heads, mc.head_dim, False)
    assert ModelConfig.from_json(mc.to_json()) == mc


def test_missing_expert_tensor_is_refused(tmp_path):
    """A checkpoint without one expert's projection fails at load, naming it."""
    from safetensors.torch import load_file, save_file

    folder = build_family(tmp_path / "moe", "glm4_moe")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="experts:5.up_proj"):
        ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512))
