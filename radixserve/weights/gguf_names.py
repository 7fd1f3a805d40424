"""GGUF tensor names -> transformers parameter names, per family, as llama.cpp's converter writes them.

Names as the `gguf` library's `constants.MODEL_TENSORS` encodes them (tests/model/test_gguf_families.py checks). Split:

    blk.{i}.ffn_{gate,up,down}_exps   (E, rows, cols) stacked experts -> mlp.experts.{e}.{gate,up,down}_proj
    blk.{i}.attn_qkv                  rows [q | k | v] (ChatGLM)      -> self_attn.{q,k,v}_proj
    blk.{i}.ffn_up  (chatglm, glm4)   rows [gate | up]               -> mlp.gate_up_proj (loaded fused)

Merged (MLA: llama.cpp's DeepseekV2 converter splits kv_b_proj (H * (nope + v), rank) per head): attn_k_b (H, rank,
nope; K transposed) and attn_v_b (H, v, rank) -> self_attn.kv_b_proj (merge_kv_b); attn_kv_b (older files) stays."""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

from radixserve.models.block_config import CORRECTION_BIAS_FAMILIES
from radixserve.models.model_config import ModelConfig

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_FFN_NORM = {"ffn_norm": "post_attention_layernorm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLM_MLP = {"ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj"}
_ROUTER = {"ffn_gate_inp": "mlp.gate"}
_SHARED = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
           "ffn_down_shexp": "mlp.shared_experts.down_proj"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MLA = {**{p: _ATTENTION[p] for p in ("attn_norm", "attn_q", "attn_output")}, "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
        **_FFN_NORM, **_MLP, **_ROUTER, **_SHARED}
_INDEXER = {"indexer.attn_k": "self_attn.indexer.wk", "indexer.attn_q_b": "self_attn.indexer.wq_b",
            "indexer.k_norm": "self_attn.indexer.k_norm", "indexer.proj": "self_attn.indexer.weights_proj"}
LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": {**_ATTENTION, **_FFN_NORM, **_MLP},
    "qwen2": {**_ATTENTION, **_FFN_NORM, **_MLP},
    "qwen3": {**_ATTENTION, **_QK_NORM, **_FFN_NORM, **_MLP},
    "qwen3_moe": {**_ATTENTION, **_QK_NORM, **_FFN_NORM, **_ROUTER},
    "glm": {**_ATTENTION, **_FFN_NORM, **_GLM_MLP},
    "glm4": {**_ATTENTION, **_FFN_NORM, **_GLM_MLP, "post_attention_norm": "post_self_attn_layernorm",
             "post_ffw_norm": "post_mlp_layernorm"},
    # glm4moe's "post_attention_norm" is the MLP's input norm
    "glm4_moe": {**_ATTENTION, **_QK_NORM, "post_attention_norm": "post_attention_layernorm", **_MLP,
                 **_ROUTER, **_SHARED},
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": {**_MLA, **_INDEXER},
}
# llama.cpp's NextN (MTP) extras of layer N = num_layers (gguf MODEL_TENSOR.NEXTN_*); its block is named as any layer's.
NEXTN = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
         "nextn.shared_head_norm": "shared_head.norm", "nextn.embed_tokens": "embed_tokens",
         "nextn.shared_head_head": "shared_head.head"}
MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
# Weights no quantized kernel reads: MLA's kv_b_proj is sliced per head, the indexer's weights_proj stays fp32.
FP32_ONLY = ("self_attn.kv_b_proj.weight", "indexer.weights_proj.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)$")


class Piece(NamedTuple):
    """One transformers tensor cut from a GGUF tensor: `index` (expert or row range) along dim 0, None: all."""

    name: str
    index: int | slice | None = None


def hf_pieces(config: ModelConfig, gguf_name: str) -> list[Piece]:
    """The transformers tensors `gguf_name` holds ([] for NextN layers past the first); ValueError if unmapped."""
    family = config.architecture
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP:
        return [Piece(f"{_TOP[base]}.{suffix}")]
    m = _BLOCK.match(gguf_name)
    if m is None:
        raise _unmapped(family, gguf_name)
    layer, part, suffix = int(m[1]), m[2], m[3]
    if layer > config.num_layers:
        return []
    prefix = f"model.layers.{layer}"
    if layer == config.num_layers and part in NEXTN:
        return [Piece(f"{prefix}.{NEXTN[part]}.{suffix}")]
    if family in MOE_FAMILIES and part in EXPERTS:
        return [Piece(f"{prefix}.mlp.experts.{e}.{EXPERTS[part]}.{suffix}", e)
                for e in range(config.moe.num_experts)]
    if family in CORRECTION_BIAS_FAMILIES and (part, suffix) == ("exp_probs_b", "bias"):
        return [Piece(f"{prefix}.mlp.gate.e_score_correction_bias")]
    module = LAYER_NAMES[family].get(part)
    if module is None:
        raise _unmapped(family, gguf_name)
    if module == "self_attn.qkv_proj":   # split, so GLM's RoPE row order is fixed per q / k
        q, kv = config.q_size, config.num_kv_heads * config.head_dim
        return [Piece(f"{prefix}.self_attn.{p}_proj.{suffix}", rows)
                for p, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv)))]
    return [Piece(f"{prefix}.{module}.{suffix}")]


def nextn_gguf_name(layer: int, short: str) -> str:
    module, _, suffix = short.rpartition(".")
    part = next(p for p, m in NEXTN.items() if m == module)
    return f"blk.{layer}.{part}.{suffix}"


def _unmapped(family: str, gguf_name: str) -> ValueError:
    note = " (llama3 RoPE frequency factors are not supported)" if gguf_name.startswith("rope_freqs.") else ""
    return ValueError(f"GGUF {family}: tensor {gguf_name!r} has no transformers mapping{note}")


def merge_kv_b(tensors: dict) -> None:
    """In place: each layer's self_attn.{k_b,v_b}_proj.weight -> self_attn.kv_b_proj.weight, per head [k_b[h].T (nope,
    rank) | v_b[h] (v, rank)], both dropped if the file has attn_kv_b too. fp32 only; ValueError: one half only."""
    for k_name in [n for n in tensors if n.endswith(".self_attn.k_b_proj.weight")]:
        v_name, kv_name = (k_name.replace(".k_b_proj.", p) for p in (".v_b_proj.", ".kv_b_proj."))
        if v_name not in tensors:
            raise ValueError(f"GGUF MLA: {k_name} (attn_k_b) has no {v_name} (attn_v_b) to rebuild kv_b_proj")
        k_b, v_b = tensors.pop(k_name), tensors.pop(v_name)
        if kv_name not in tensors:
            tensors[kv_name] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()
    stray = [n for n in tensors if n.endswith(".self_attn.v_b_proj.weight")]
    if stray:
        raise ValueError(f"GGUF MLA: {stray[0]} (attn_v_b) has no matching attn_k_b to rebuild kv_b_proj")
