"""GGUF loading for the MLA families the `gguf` library maps (docs/gguf.md): GLM-4.7-Flash (glm4_moe_lite, written as
llama.cpp's `deepseek2`) and GLM-5 (glm_moe_dsa, `glm-dsa`, with its DSA indexer); DeepSeek-V3.2 has no GGUF form.

Each tiny random checkpoint (test_families.py) is written as llama.cpp's DeepseekV2 converter writes it
(gguf_convert.py: kv_b_proj split per head into k_b / v_b, head_count_kv 1, no RoPE permutation), once in F32 and
once with Q8_0 weights. The F32 file loads to the safetensors checkpoint's ModelConfig and exactly its tensors, and the
engine's logits at every position equal transformers' on the checkpoint; the Q8_0 file's tensors equal the checkpoint's
Q8_0 round trip. What the library cannot express is refused with a ValueError naming what is missing.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.layers.quant_linear import Int8Weight
from radixserve.models.model_config import ModelConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.weights.gguf_names import merge_kv_b
from radixserve.weights.loader import load_checkpoint
from radixserve.weights.safetensors import read_hf_config
from tests.model.gguf_convert import write_gguf
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_gguf_families import _meta
from tests.model.parity import assert_parity, engine_generate, hf_greedy
from tests.model.test_mla import forward_logits
from tests.model.test_parity import make_engine, prompt_set
from tests.model.test_runner import Seq

ATOL = 1e-4


def _spec(family: str, **extra) -> tuple[str, str, dict]:
    config_cls, model_cls, kwargs = FAMILIES[family]
    # llama.cpp's converter reads first_k_dense_replace (released GLM-4.7-Flash config.json files carry it).
    return config_cls, model_cls, {**kwargs, "vocab_size": 512, "first_k_dense_replace": 1, **extra}


# case: (family, checkpoint spec)
CASES = {
    "glm4_moe_lite": ("glm4_moe_lite", _spec("glm4_moe_lite")),
    "glm4_moe_lite_no_q_lora": ("glm4_moe_lite", _spec("glm4_moe_lite", q_lora_rank=None)),
    "glm_moe_dsa": ("glm_moe_dsa", _spec("glm_moe_dsa")),
    # IndexShare: the shared layers have no indexer tensors, which is how the file says so.
    "glm_moe_dsa_index_share": ("glm_moe_dsa", _spec("glm_moe_dsa", num_hidden_layers=4, index_topk_pattern="FSFS")),
}
# Weights whose input width (the quantized dim) is a multiple of Q8_0's 32-value block in these configs; attn_output
# (H * v_head_dim = 48 wide) and the 3-D k_b / v_b halves stay F32. The writer keys on the name's last part, so
# attn_q_b also covers indexer.attn_q_b.
Q8_0 = {part: "Q8_0" for part in ("token_embd", "output", "attn_q", "attn_q_a", "attn_q_b", "attn_kv_a_mqa",
                                  "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                  "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_k", "proj")}
Q8_0_HF = ("embed_tokens", "lm_head", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj",
           "down_proj", "indexer.wk", "indexer.wq_b", "indexer.weights_proj")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(autouse=True)
def _private_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache_dir))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, spec = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_dir = build_family(folder / "hf", family, seed=1, spec=spec)
    write_gguf(hf_dir, folder / "f32.gguf")
    write_gguf(hf_dir, folder / "q8_0.gguf", Q8_0)
    return family, folder


def _as_stored(config: ModelConfig) -> ModelConfig:
    """`config` with the floats GGUF stores as float32 rounded so."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    moe = dataclasses.replace(config.moe, routed_scaling_factor=f32(config.moe.routed_scaling_factor))
    return dataclasses.replace(config, rms_norm_eps=f32(config.rms_norm_eps), moe=moe)


def test_config_and_tensors_equal_safetensors(case):
    """The same ModelConfig (indexer full layers included) and every tensor bit for bit: kv_b_proj rebuilt from the
    k_b / v_b halves, experts unstacked, no row permuted."""
    family, folder = case
    config, tensors = load_checkpoint(str(folder / "f32.gguf"))
    ref_config = ModelConfig.from_hf(read_hf_config(str(folder / "hf")))
    assert config.architecture == family and _as_stored(config) == _as_stored(ref_config)
    got, ref = dict(tensors), dict(load_checkpoint(str(folder / "hf"))[1])
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name


@torch.inference_mode()
def test_logits_equal_transformers_at_every_position(case):
    """The F32 file through the runner: a prompt in chunks that straddle index_topk, then decodes; every logit row
    within 1e-4 of transformers' one forward over the HF checkpoint."""
    from transformers import AutoModelForCausalLM

    _, folder = case
    hf = AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32).eval()
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder / "f32.gguf"), page_size=16,
                                                  max_total_tokens=512, quantization="none"))
    rng = random.Random(0)
    seq = Seq("a", [rng.randrange(3, 512) for _ in range(70)], list(range(runner.num_pages))[::-1])
    ours = [forward_logits(runner, seq, n) for n in (5, 30, 12, 23)]
    for _ in range(6):
        seq.output.append(int(ours[-1][-1].argmax()))
        ours.append(forward_logits(runner, seq, 1))
    ref = hf(torch.tensor([seq.tokens])).logits[0, :seq.computed]
    assert float((torch.cat(ours) - ref).abs().max()) <= ATOL


def test_engine_greedy_equals_transformers(case):
    """The F32 file through the engine (scheduler, chunked prefill, radix cache), batched: transformers' greedy tokens
    on the HF checkpoint, one prompt at a time (tie rule): transformers' left-padded batch is no reference for DSA
    (its padding can change its own top-k, docs/gguf.md)."""
    from transformers import AutoModelForCausalLM

    family, folder = case
    prompts = prompt_set(512, 3, [1, 7, 24, 65, 140])
    hf = AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32).eval()
    ours, _ = engine_generate(make_engine(folder / "f32.gguf"), prompts, 12)
    for i, (tokens, prompt) in enumerate(zip(ours, prompts)):
        ref, logits = hf_greedy(hf, prompt, 12)
        assert_parity(tokens, ref, logits, f"{family} prompt {i}")


def test_q8_0_tensors_equal_the_checkpoints_round_trip(case):
    """Q8_0 blocks dequantized exactly as the `gguf` library does; --quantization int8 keeps kv_b_proj and the
    indexer's weights_proj fp32 (no quantized kernel reads them)."""
    import gguf

    _, folder = case
    q8 = gguf.GGMLQuantizationType.Q8_0
    got = dict(load_checkpoint(str(folder / "q8_0.gguf"))[1])
    for name, tensor in load_checkpoint(str(folder / "hf"))[1]:
        quantized = tensor.dim() >= 2 and any(f".{p}." in f".{name}" for p in Q8_0_HF)
        want = (torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), q8), q8))
                if quantized else tensor)
        assert torch.equal(got[name], want), name
    int8 = dict(load_checkpoint(str(folder / "q8_0.gguf"), "int8")[1])
    assert isinstance(int8["model.layers.1.self_attn.o_proj.weight"], Int8Weight)
    assert isinstance(int8["model.layers.1.self_attn.kv_b_proj.weight"], torch.Tensor)
    if "model.layers.0.self_attn.indexer.weights_proj.weight" in int8:
        assert isinstance(int8["model.layers.0.self_attn.indexer.weights_proj.weight"], torch.Tensor)


@torch.inference_mode()
def test_int4_serves_q4_0_blocks_with_rope_rows_reordered(tmp_path):
    """--quantization int4 on a Q4_0 GLM-4.7-Flash file: q_b_proj and kv_a_proj_with_mqa run as Int4Weight with their
    rope rows de-interleaved as the fp32 ones are: each layer times the identity gives the fp32-served weight up to
    the int4 kernel's bf16 rounding (a row mix-up is off by whole weights)."""
    from radixserve.layers.quant_linear import Int4Weight

    family, spec = CASES["glm4_moe_lite"]
    path = tmp_path / "q4_0.gguf"
    write_gguf(build_family(tmp_path / "hf", family, seed=1, spec=spec), path, {p: "Q4_0" for p in Q8_0})
    assert isinstance(dict(load_checkpoint(str(path), "int4")[1])["model.layers.1.self_attn.q_b_proj.weight"],
                      Int4Weight)
    served = {}
    for quantization in ("none", "int4"):
        runner = ModelRunner.from_config(EngineConfig(model_path=str(path), max_total_tokens=512,
                                                      quantization=quantization))
        modules = dict(runner.model.named_modules())
        served[quantization] = {name: modules[name](torch.eye(modules[name].in_features))
                                for name in ("model.layers.1.self_attn.q_b_proj",
                                             "model.layers.1.self_attn.kv_a_proj_with_mqa")}
    for name, ref in served["none"].items():
        assert float((served["int4"][name] - ref).abs().max()) <= float(ref.abs().max()) / 256, name   # bf16 ulp


MLA = {"attention.kv_lora_rank": 32, "attention.key_length_mla": 24, "attention.value_length_mla": 12,
       "rope.dimension_count": 8, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
INDEXER = {"attention.indexer.head_count": 16, "attention.indexer.key_length": 32, "attention.indexer.top_k": 8}


def _indexer_tensors(layer: int, leave_out: str = "") -> set[str]:
    parts = ("attn_k.weight", "attn_q_b.weight", "k_norm.weight", "k_norm.bias", "proj.weight")
    return {f"blk.{layer}.indexer.{p}" for p in parts if p != leave_out}


def test_what_gguf_cannot_express_is_refused():
    sigmoid = {**MLA, "expert_gating_func": 2}
    # DeepSeek-V3.2: the library's deepseek2 has no indexer, glm-dsa's indexer is GLM-5's (interleaved RoPE).
    with pytest.raises(ValueError, match="'deepseek2' with a DSA indexer .*DeepSeek-V3.2.*no GGUF form"):
        ModelConfig.from_gguf(_meta("deepseek2", **sigmoid, **INDEXER), set())
    with pytest.raises(ValueError, match="'deepseek2' with a DSA indexer"):
        ModelConfig.from_gguf(_meta("deepseek2", **sigmoid), _indexer_tensors(0))
    # Softmax routing (DeepSeek-V2), or no gating key, which llama.cpp reads as softmax for these files.
    for keys in (MLA, {**MLA, "expert_gating_func": 1}):
        with pytest.raises(ValueError, match="softmax expert gating .*not supported"):
            ModelConfig.from_gguf(_meta("deepseek2", **keys), set())
    with pytest.raises(ValueError, match="metadata lacks glm-dsa.attention.indexer.top_k"):
        ModelConfig.from_gguf(_meta("glm-dsa", **sigmoid, **{k: v for k, v in INDEXER.items() if "top_k" not in k}),
                              _indexer_tensors(0))
    with pytest.raises(ValueError, match="glm-dsa: layer 0 has no DSA indexer tensors"):
        ModelConfig.from_gguf(_meta("glm-dsa", **sigmoid, **INDEXER), _indexer_tensors(1))
    with pytest.raises(ValueError, match=r"glm-dsa: layer 1 lacks indexer tensors blk\.1\.indexer\.k_norm\.bias"):
        ModelConfig.from_gguf(_meta("glm-dsa", **sigmoid, **INDEXER),
                              _indexer_tensors(0) | _indexer_tensors(1, "k_norm.bias"))
    with pytest.raises(ValueError, match="metadata lacks deepseek2.attention.value_length_mla"):
        ModelConfig.from_gguf(_meta("deepseek2", **{k: v for k, v in sigmoid.items() if "value_length" not in k}),
                              set())
    ok = ModelConfig.from_gguf(_meta("glm-dsa", **sigmoid, **INDEXER), _indexer_tensors(0))
    assert ok.dsa.full_layers == (0,) and ok.dsa.index_rope_interleaved and ok.mla.q_lora_rank is None


def test_half_of_a_split_kv_b_is_refused():
    k_b = "model.layers.0.self_attn.k_b_proj.weight"
    with pytest.raises(ValueError, match=r"k_b_proj.weight \(attn_k_b\) has no .*v_b_proj.weight \(attn_v_b\)"):
        merge_kv_b({k_b: torch.zeros(4, 32, 16)})
    with pytest.raises(ValueError, match=r"v_b_proj.weight \(attn_v_b\) has no matching attn_k_b"):
        merge_kv_b({k_b.replace("k_b", "v_b"): torch.zeros(4, 12, 32)})
