"""ModelConfig: one frozen description of a decoder model, normalised from HF config.json or GGUF metadata."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# HF `architectures[0]` / GGUF `general.architecture` -> our family name.
_FAMILIES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "llama": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "qwen3_moe": "qwen3_moe",
    "GlmForCausalLM": "glm", "glm": "glm",
    "Glm4ForCausalLM": "glm4", "glm4": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe", "glm4_moe": "glm4_moe",
}
_GLM = ("glm", "glm4", "glm4_moe")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear`: every inverse frequency / factor. `llama3`: Llama 3.1's
    wavelength-banded scaling (transformers `_compute_llama3_parameters`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A routed-experts MLP (glm4_moe: DeepSeek-style; qwen3_moe), see layers/moe.py.

    `scoring`: "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5: sigmoid scores, `correction_bias`
    steering selection only, group-limited top-k over `num_groups` groups keeping `topk_groups`).
    Weights of the chosen experts are renormalised when `norm_topk_prob`, then scaled by
    `routed_scaling_factor`. `num_shared_experts` always-on experts form one MLP of width
    intermediate_size * num_shared_experts. Layers in `dense_layers` use the ordinary MLP."""

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
class ModelConfig:
    """Shapes and options of a Llama-family decoder. Head counts are per layer; sizes in elements.

    Flags let relatives reuse the Llama decoder: `qkv_bias` (Qwen2, GLM), `qk_norm` (Qwen3,
    GLM-4.5 optionally: RMSNorm over each head of q and k before RoPE), `o_bias` / `mlp_bias`
    (Llama's attention_bias / mlp_bias options), `rotary_dim` (GLM: RoPE over the first
    rotary_dim dims of each head only; None = all), `rope_interleaved` (GLM-4, GLM-4-0414: RoPE
    pairs dims (2i, 2i+1), which the loader turns into the half-split layout by permuting q/k
    rows), `post_norms` (GLM-4-0414: RMSNorm on each sublayer's output before the residual add),
    `moe` (routed experts, see MoEConfig).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    rope_interleaved: bool = False
    post_norms: bool = False
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only silu / SwiGLU)")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]")

    @property
    def rot_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Normalise a transformers config.json dict (4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = (cfg.get("architectures") or [cfg.get("model_type", "llama")])[0]
        family = _FAMILIES.get(arch) or _FAMILIES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"unsupported architecture {arch!r}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        glm = family in _GLM
        attention_bias = bool(cfg.get("attention_bias", family in ("glm", "glm4")))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5 if glm else 1.0))
        rotary_dim = int(head_dim * partial)
        return cls(
            architecture=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(scaling), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids, hidden_act=cfg.get("hidden_act", "silu"),
            qkv_bias=attention_bias or family == "qwen2", o_bias=attention_bias and not glm,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm", False)),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            rope_interleaved=family in ("glm", "glm4"), post_norms=family == "glm4",
            moe=_moe(family, cfg))

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """Normalise GGUF key/values (`{arch}.block_count`, ...). `has_output_weight`: whether
        the file holds `output.weight` (absent means tied embeddings)."""
        arch = meta["general.architecture"]
        family = _FAMILIES.get(arch)
        if family is None:
            raise ValueError(f"unsupported GGUF architecture {arch!r}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        num_heads = get("attention.head_count")
        hidden = get("embedding_length")
        scaling = None
        if get("rope.scaling.type", "none") not in ("none", None):
            scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0),
                       "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        return cls(
            architecture=family, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=get("feed_forward_length"), num_layers=get("block_count"),
            num_heads=num_heads, num_kv_heads=get("attention.head_count_kv") or num_heads,
            head_dim=get("attention.key_length") or hidden // num_heads,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings=not has_output_weight, rope_scaling=_rope_scaling(scaling),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3")

    # ---- (de)serialisation for the dequantized-weight cache ----------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"]) if d["rope_scaling"] else None
        if d.get("moe"):
            d["moe"] = MoEConfig(**{**d["moe"], "dense_layers": tuple(d["moe"]["dense_layers"])})
        return cls(**d)


def _moe(family: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The routed-experts settings of a glm4_moe or qwen3_moe config.json (None otherwise)."""
    layers = range(cfg["num_hidden_layers"])
    # Released configs name the expert count n_routed_experts (GLM) / num_experts (Qwen);
    # transformers 5.x writes num_local_experts.
    num_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if family == "glm4_moe":
        return MoEConfig(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_shared_experts=cfg.get("n_shared_experts", 1), num_groups=cfg.get("n_group", 1),
            topk_groups=cfg.get("topk_group", 1),
            dense_layers=tuple(range(min(cfg.get("first_k_dense_replace", 1), len(layers)))))
    if family == "qwen3_moe":
        step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        return MoEConfig(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=tuple(i for i in layers if i in dense_only or (i + 1) % step))
    return None


def _rope_scaling(d: dict[str, Any] | None) -> RopeScaling | None:
    """Map a rope-scaling dict to RopeScaling; raises ValueError for types we do not implement."""
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default", "none"):
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    return RopeScaling(rope_type=kind, factor=float(d.get("factor", 1.0)),
                       low_freq_factor=float(d.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(d.get("high_freq_factor", 4.0)),
                       original_max_position_embeddings=d.get("original_max_position_embeddings"))
