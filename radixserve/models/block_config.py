"""ModelConfig's optional blocks, read from config.json / GGUF metadata: MoE (routed experts), MLA and DSA's indexer."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

DSA_FAMILIES = ("glm_moe_dsa", "deepseek_v32")
NEXTN_FAMILIES = ("glm4_moe", "glm_moe_dsa", "deepseek_v32")   # checkpoints that carry a NextN (MTP) layer
# Sigmoid routing with a selection-only correction bias (GGUF exp_probs_b).
CORRECTION_BIAS_FAMILIES = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
# A full DSA layer's indexer tensors in a glm-dsa GGUF file (gguf.TENSOR_NAMES' blk.{bid}.indexer.*), weight or bias.
INDEXER_TENSORS = ("attn_k.weight", "attn_q_b.weight", "k_norm.weight", "k_norm.bias", "proj.weight")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (models/moe.py): `scoring` "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5); `dense_layers` use the MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    num_groups: int = 1
    topk_groups: int = 1
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; models/mla.py): q_lora_rank None projects q directly."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention's lightning indexer (GLM-5, DeepSeek-V3.2; models/dsa.py): `full_layers` run their own
    indexer and store one index key per token; the others (IndexShare) reuse the last full layer's top-k;
    `index_rope_interleaved`: the indexer's RoPE pairs (2i, 2i+1) (GLM-5) or (i, i + rope/2) (DeepSeek-V3.2)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    full_layers: tuple[int, ...]
    index_rope_interleaved: bool = True


def mla_from_hf(family: str, cfg: dict[str, Any]) -> MLAConfig | None:
    if family not in ("glm4_moe_lite", *DSA_FAMILIES):
        return None
    return MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     v_head_dim=cfg["v_head_dim"])


def dsa_from_hf(family: str, cfg: dict[str, Any]) -> DSAConfig | None:
    """glm_moe_dsa's indexer settings; which layers are full follows transformers' GlmMoeDsaConfig: `indexer_types`,
    else `index_topk_pattern` ("F"/"S" string or list), else full iff max(i - offset + 1, 0) % freq == 0 with
    freq = index_topk_freq (1), offset = index_skip_topk_offset (2). ValueError when layer 0 is not full."""
    if family not in DSA_FAMILIES:
        return None
    n = cfg["num_hidden_layers"]
    types = cfg.get("indexer_types") if family == "glm_moe_dsa" else ["full"] * n
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) < n or types[0] != "full" or set(types) - {"full", "shared"}:
        raise ValueError(f"glm_moe_dsa: indexer types {types} must name 'full' or 'shared' for each of {n} layers, "
                         "layer 0 full")
    return DSAConfig(index_n_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
                     index_topk=cfg["index_topk"], full_layers=tuple(i for i in range(n) if types[i] == "full"),
                     index_rope_interleaved=family == "glm_moe_dsa")


def moe_from_hf(family: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The routed-experts settings of a glm4_moe(_lite) or qwen3_moe config.json (None otherwise); glm4_moe_lite's dense
    layers are its `mlp_layer_types` (transformers ignores its first_k_dense_replace)."""
    layers = range(cfg["num_hidden_layers"])
    num_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if family in ("glm4_moe", "glm4_moe_lite", *DSA_FAMILIES):
        first = cfg.get("first_k_dense_replace", 3) if family in DSA_FAMILIES else 1
        types = cfg.get("mlp_layer_types") or ["dense"] * first + ["sparse"] * (len(layers) - first)
        dense = (tuple(i for i in layers if types[i] == "dense") if family != "glm4_moe"
                 else tuple(range(min(cfg.get("first_k_dense_replace", 1), len(layers)))))
        return MoEConfig(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_shared_experts=cfg.get("n_shared_experts", 1), num_groups=cfg.get("n_group", 1),
            topk_groups=cfg.get("topk_group", 1), dense_layers=dense)
    if family == "qwen3_moe":
        step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        return MoEConfig(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=tuple(i for i in layers if i in dense_only or (i + 1) % step))
    return None


def mla_from_gguf(family: str, get: Callable[..., Any]) -> MLAConfig | None:
    """MLA sizes as llama.cpp's DeepseekV2 converter writes them (deepseek2, glm-dsa): attention.kv_lora_rank,
    attention.q_lora_rank (absent: no q LoRA), rope.dimension_count = qk_rope_head_dim, attention.key_length_mla =
    qk_nope + qk_rope, attention.value_length_mla = v_head_dim (key_length / value_length are its MQA view)."""
    if family not in ("glm4_moe_lite", *DSA_FAMILIES):
        return None
    rope = get("rope.dimension_count")
    return MLAConfig(q_lora_rank=get("attention.q_lora_rank", None), kv_lora_rank=get("attention.kv_lora_rank"),
                     qk_nope_head_dim=get("attention.key_length_mla") - rope, qk_rope_head_dim=rope,
                     v_head_dim=get("attention.value_length_mla"))


def dsa_from_gguf(family: str, get: Callable[..., Any], num_layers: int,
                  tensor_names: Collection[str]) -> DSAConfig | None:
    """glm-dsa's indexer (attention.indexer.head_count / key_length / top_k). gguf (0.19) has no IndexShare layer-type
    key: a layer is full iff the file holds its indexer tensors; ValueError: layer 0 has none, or a layer only some."""
    if family != "glm_moe_dsa":
        return None
    full = []
    for i in range(num_layers):
        held = {p for p in INDEXER_TENSORS if f"blk.{i}.indexer.{p}" in tensor_names}
        if held and held != set(INDEXER_TENSORS):
            raise ValueError(f"GGUF glm-dsa: layer {i} lacks indexer tensors "
                             f"{', '.join(f'blk.{i}.indexer.{p}' for p in INDEXER_TENSORS if p not in held)}")
        if held:
            full.append(i)
    if 0 not in full:
        raise ValueError("GGUF glm-dsa: layer 0 has no DSA indexer tensors (blk.0.indexer.attn_k / attn_q_b / k_norm / "
                         "proj); the model cannot pick its top-k without them")
    return DSAConfig(index_n_heads=get("attention.indexer.head_count"),
                     index_head_dim=get("attention.indexer.key_length"), index_topk=get("attention.indexer.top_k"),
                     full_layers=tuple(full), index_rope_interleaved=True)


def moe_from_gguf(arch: str, family: str, get: Callable[..., Any], num_layers: int) -> MoEConfig | None:
    """MoE settings as llama.cpp reads them (qwen3moe: always softmax, renormalised; deepseek2 and glm-dsa without
    expert_gating_func: softmax, llama.cpp's default for DeepSeek-V2 files); ValueError for other gating, and for
    softmax routing in an MLA file (DeepSeek-V2's routing is not implemented; GLM's is sigmoid)."""
    if family not in ("qwen3_moe", *CORRECTION_BIAS_FAMILIES):
        return None
    experts = dict(num_experts=get("expert_count"), top_k=get("expert_used_count"),
                   intermediate_size=get("expert_feed_forward_length"))
    if family == "qwen3_moe":
        return MoEConfig(**experts, scoring="softmax", norm_topk_prob=True)
    scoring = {1: "softmax", 2: "sigmoid"}.get(get("expert_gating_func", 2 if family == "glm4_moe" else 1))
    if scoring is None:
        raise ValueError(f"GGUF architecture {arch!r}: expert_gating_func {get('expert_gating_func')} "
                         "is not supported (1 softmax, 2 sigmoid)")
    if scoring == "softmax" and family != "glm4_moe":
        raise ValueError(f"GGUF architecture {arch!r}: softmax expert gating (DeepSeek-V2 / V2.5 routing, also "
                         "llama.cpp's default when expert_gating_func is absent) is not supported; the MLA models "
                         "route as GLM-4.7-Flash / GLM-5 / DeepSeek-V3 do (expert_gating_func 2, sigmoid)")
    return MoEConfig(
        **experts, scoring=scoring, norm_topk_prob=bool(get("expert_weights_norm", False)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        num_shared_experts=get("expert_shared_count", 0), num_groups=get("expert_group_count", 1),
        topk_groups=get("expert_group_used_count", 1),
        dense_layers=tuple(range(min(get("leading_dense_block_count", 0), num_layers))))


def check_nextn_family(architecture: str) -> None:
    """ValueError unless `architecture`'s checkpoints carry a NextN layer for --speculative-algorithm EAGLE/NEXTN."""
    if architecture not in NEXTN_FAMILIES:
        raise ValueError(f"--speculative-algorithm EAGLE/NEXTN drafts with a checkpoint's NextN (MTP) layer; "
                         f"{architecture!r} has none here (supported: {', '.join(NEXTN_FAMILIES)}; "
                         f"or give a trained head with --speculative-draft-model-path)")
