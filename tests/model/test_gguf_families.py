"""GGUF loading for the families llama.cpp converts: Qwen2, Qwen3, Qwen3-MoE, GLM-4 (chatglm), GLM-4-0414, GLM-4.5.

Each family's tiny random checkpoint (test_families.py) is written as llama.cpp's converter
writes it (gguf_convert.py), once in F32 and once with Q8_0 weights. The F32 file loads to the
safetensors checkpoint's ModelConfig and exactly its tensors (so the same model); the Q8_0
file gives, through the engine, the greedy tokens of a checkpoint holding its dequantized
weights. Where transformers loads the family from GGUF
itself (Qwen2, Qwen3, Qwen3-MoE), its greedy tokens agree too (tie rule). What cannot be
mapped is refused with a ValueError naming the architecture and what is missing.
"""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from radixserve.layers.quant_linear import Int4Weight
from radixserve.models.block_config import CORRECTION_BIAS_FAMILIES
from radixserve.models.model_config import GGUF_FAMILIES, ModelConfig
from radixserve.models.block_config import NEXTN_FAMILIES
from radixserve.weights.gguf_names import EXPERTS, LAYER_NAMES, MOE_FAMILIES, NEXTN, hf_pieces
from radixserve.weights.loader import load_checkpoint
from radixserve.weights.safetensors import read_hf_config
from tests.model.gguf_convert import write_gguf
from tests.model.parity import assert_parity, engine_generate, hf_greedy_batch
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_parity import make_engine, prompt_set

NUM_NEW = 16
LENGTHS = [1, 7, 24, 65, 129]   # 129: past one 128-token chunk
# Every weight of two dims or more; the converter keeps the router (ffn_gate_inp) in F32.
Q8_0 = {part: "Q8_0" for part in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                                  "ffn_gate", "ffn_up", "ffn_down", *EXPERTS, "ffn_gate_shexp", "ffn_up_shexp",
                                  "ffn_down_shexp")}


def _spec(family: str, **extra) -> tuple[str, str, dict]:
    config_cls, model_cls, kwargs = FAMILIES[family]
    return config_cls, model_cls, {**kwargs, **extra}


# case: (family, checkpoint spec, write_gguf options)
CASES = {
    "qwen2": ("qwen2", ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2)), {}),
    "qwen3": ("qwen3", _spec("qwen3"), {}),
    # llama.cpp's qwen3moe has no dense layers (its converter cannot name one).
    "qwen3_moe": ("qwen3_moe", _spec("qwen3_moe", mlp_only_layers=[]), {}),
    # ChatGLM's converter reads the RMS eps from `layernorm_epsilon` (default 1e-5) and the
    # context length from `seq_length`: set so that both files say the same.
    "glm": ("glm", _spec("glm", rms_norm_eps=1e-5, seq_length=1024), {}),
    "glm_fused_qkv": ("glm", _spec("glm", rms_norm_eps=1e-5, seq_length=1024), {"fuse_qkv": True}),
    "glm4": ("glm4", _spec("glm4"), {}),
    "glm4_moe": ("glm4_moe", _spec("glm4_moe"), {}),
}
# transformers' GGUF_CONFIG_MAPPING. It reads neither qwen3's attention.key_length nor
# qwen3moe's expert_feed_forward_length (its defaults fit the released models), so the tiny
# models' values are passed.
HF_READS_GGUF = {"qwen2": {}, "qwen3": {"head_dim": 16}, "qwen3_moe": {"moe_intermediate_size": 32}}


def _add_mtp_layer(folder, num_layers: int) -> None:
    """GLM-4.5 checkpoints hold a multi-token-prediction layer after the last decoder layer."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    rng = np.random.default_rng(0)
    mtp = f"model.layers.{num_layers}"
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
                        ("shared_head.norm.weight", (64,)), ("input_layernorm.weight", (64,))):
        tensors[f"{mtp}.{name}"] = rng.standard_normal(shape).astype(np.float32)
    save_file(tensors, path, metadata={"format": "pt"})


def _dequantized_twin(hf_dir, folder) -> None:
    """A copy of `hf_dir` whose weights went through Q8_0 and back, as write_gguf(types=Q8_0)
    stores them (every weight of two dims or more but the router)."""
    import gguf
    from safetensors.numpy import load_file, save_file

    folder.mkdir()
    shutil.copy(hf_dir / "config.json", folder / "config.json")
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {name: gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8).astype(np.float32)
               if a.ndim >= 2 and not name.endswith("mlp.gate.weight") else a
               for name, a in load_file(hf_dir / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(autouse=True)
def _private_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache_dir))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, spec, options = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_dir = build_family(folder / "hf", family, spec=spec)
    if family == "glm4_moe":
        _add_mtp_layer(hf_dir, spec[2]["num_hidden_layers"])
    write_gguf(hf_dir, folder / "f32.gguf", **options)
    write_gguf(hf_dir, folder / "q8_0.gguf", Q8_0, **options)
    _dequantized_twin(hf_dir, folder / "q8_0-twin")
    prompts = prompt_set(256, 2, LENGTHS)
    return family, folder, prompts


def greedy(path, prompts) -> list[list[int]]:
    return engine_generate(make_engine(path), prompts, NUM_NEW)[0]


def test_config_equals_safetensors(case):
    """Every field, the RMS eps as the float32 GGUF stores."""
    family, folder, _ = case
    ref = ModelConfig.from_hf(read_hf_config(str(folder / "hf")))
    for name in ("f32.gguf", "q8_0.gguf"):
        config, _ = load_checkpoint(str(folder / name))
        assert np.float32(config.rms_norm_eps) == np.float32(ref.rms_norm_eps), name
        assert config == dataclasses.replace(ref, rms_norm_eps=config.rms_norm_eps), name
    assert config.architecture == family
    assert config.rot_dim == (config.head_dim // 2 if family.startswith("glm") else config.head_dim)
    assert (config.moe is not None) == (family in MOE_FAMILIES)


def test_tensors_equal_safetensors(case):
    """Names, shapes and values: experts unstacked, q/k/v split, GLM's fused gate_up kept, no
    row permuted, the MTP layer's blk.N.nextn.* mapped back (test_gguf_mtp.py)."""
    _, folder, _ = case
    got = dict(load_checkpoint(str(folder / "f32.gguf"))[1])
    ref = dict(load_checkpoint(str(folder / "hf"))[1])
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name


def test_q8_0_greedy_tokens_equal_its_dequantized_twin(case):
    """End to end through the engine. (The F32 file needs no run of its own: its config and
    every tensor equal the safetensors checkpoint's, the two tests above.)"""
    _, folder, prompts = case
    assert greedy(folder / "q8_0.gguf", prompts) == greedy(folder / "q8_0-twin", prompts)


def test_transformers_gguf_loader_agrees(case):
    family, folder, prompts = case
    if family not in HF_READS_GGUF:
        pytest.skip(f"transformers has no GGUF loader for {family}")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="f32.gguf", dtype=torch.float32,
                                              **HF_READS_GGUF[family]).eval()
    refs = hf_greedy_batch(hf, prompts, NUM_NEW)
    for i, (ours, (ref, logits)) in enumerate(zip(greedy(folder / "f32.gguf", prompts), refs)):
        assert_parity(ours, ref, logits, f"{family} prompt {i}")


def test_moe_int4_quantizes_linear_layers_and_keeps_experts_fp32(tmp_path):
    """--quantization int4 on a Q4_0 GLM-4.5 file: attention and shared-expert weights become
    Int4Weight, the stacked routed experts are dequantized per expert (no int4 MoE kernel)."""
    hf_dir = build_family(tmp_path / "hf", "glm4_moe")
    path = tmp_path / "q4.gguf"
    write_gguf(hf_dir, path, {p: "Q4_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", *EXPERTS,
                                                  "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")})
    _, int4 = load_checkpoint(str(path), "int4")
    _, fp32 = load_checkpoint(str(path), "none")
    int4, fp32 = dict(int4), dict(fp32)
    assert isinstance(int4["model.layers.1.self_attn.q_proj.weight"], Int4Weight)
    assert isinstance(int4["model.layers.1.mlp.shared_experts.down_proj.weight"], Int4Weight)
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert isinstance(int4[expert], torch.Tensor) and torch.equal(int4[expert], fp32[expert])


@pytest.mark.parametrize("family", sorted(LAYER_NAMES))
def test_names_are_the_gguf_librarys(family):
    """Each GGUF name radixserve maps is one the `gguf` library gives the family's architecture,
    for the same transformers module (what llama.cpp's converter writes)."""
    import gguf

    arch_name = next(a for a, f in GGUF_FAMILIES.items() if f == family)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    known = {gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") for t in gguf.MODEL_TENSORS[arch]}
    names = gguf.get_tensor_name_map(arch, 1)
    parts = dict(LAYER_NAMES[family], **({p: f"mlp.experts.{m}" for p, m in EXPERTS.items()}
                                          if family in MOE_FAMILIES else {}),
                 **(NEXTN if family in NEXTN_FAMILIES else {}))
    assert set(parts) <= known, set(parts) - known
    if family in CORRECTION_BIAS_FAMILIES:
        assert names.get_name("model.layers.0.mlp.gate.e_score_correction.bias",
                              try_suffixes=(".bias",)) == "blk.0.exp_probs_b.bias"
    for part, module in parts.items():
        hf = "self_attn.query_key_value" if module == "self_attn.qkv_proj" else module
        assert names.get_name(f"model.layers.0.{hf}.weight", try_suffixes=(".weight",)) == f"blk.0.{part}.weight"


def test_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "qwen2moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2moe'"):
        load_checkpoint(str(path))


def _meta(arch: str, **keys) -> dict:
    """Minimal metadata of a 2-layer `arch` model plus `keys` (without the arch prefix)."""
    base = dict(block_count=2, embedding_length=64, feed_forward_length=128, **{"attention.head_count": 4})
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}}


def test_unmappable_metadata_and_tensors_are_refused():
    moe = dict(expert_used_count=2, expert_feed_forward_length=32)
    with pytest.raises(ValueError, match="'glm4moe': metadata lacks glm4moe.expert_count"):
        ModelConfig.from_gguf(_meta("glm4moe", **moe), set())
    with pytest.raises(ValueError, match="expert_gating_func 3"):
        ModelConfig.from_gguf(_meta("glm4moe", **moe, expert_count=8, expert_gating_func=3), set())
    with pytest.raises(ValueError, match="'glm4': M-RoPE"):
        ModelConfig.from_gguf(_meta("glm4", **{"rope.dimension_sections": [8, 12, 12, 0]}), set())
    # Mixtral-style experts in a Llama file: no mapping, not silently dropped.
    llama = ModelConfig.from_gguf(_meta("llama"), set())
    with pytest.raises(ValueError, match="GGUF llama: tensor 'blk.0.ffn_gate_exps.weight'"):
        hf_pieces(llama, "blk.0.ffn_gate_exps.weight")
