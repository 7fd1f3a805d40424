"""ModelConfig: one frozen description of a decoder model, normalised from HF config.json or GGUF metadata."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixserve.models.block_config import (DSA_FAMILIES, DSAConfig, MLAConfig, MoEConfig, dsa_from_gguf, dsa_from_hf,
                                             mla_from_gguf, mla_from_hf, moe_from_gguf, moe_from_hf)
from radixserve.models.sliding_window import SlidingWindow, window_from_gguf, window_from_hf

# HF `architectures[0]` (or `model_type`) -> our family name.
_FAMILIES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "llama": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "qwen3_moe": "qwen3_moe",
    "GlmForCausalLM": "glm", "glm": "glm",
    "Glm4ForCausalLM": "glm4", "glm4": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe", "glm4_moe": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "glm4_moe_lite": "glm4_moe_lite",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa", "glm_moe_dsa": "glm_moe_dsa",
    "DeepseekV32ForCausalLM": "deepseek_v32", "deepseek_v32": "deepseek_v32",
}
# GGUF `general.architecture` (llama.cpp's names) -> our family name; llama.cpp names GLM-4-9B-hf "chatglm", writes
# GLM-4.7-Flash (and DeepSeek-V2/V3) as "deepseek2" and GLM-5 as "glm-dsa" (docs/gguf.md).
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "chatglm": "glm", "glm4": "glm4", "glm4moe": "glm4_moe", "deepseek2": "glm4_moe_lite",
                 "glm-dsa": "glm_moe_dsa"}
_REQUIRED = object()
_GLM = ("glm", "glm4", "glm4_moe")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (Peng et al. 2023, arXiv 2309.00071, eq. 21, as
    DeepSeek-V2 parameterises it with `mscale`); 1.0 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """`linear`: inv_freq / factor; `llama3`: Llama 3.1's banded scaling (transformers `_compute_llama3_parameters`);
    `yarn` (MLA models only): YaRN's frequencies (layers/rotary.py yarn_inv_freq) with `beta_fast` / `beta_slow` /
    `truncate`, cos and sin times `cos_sin_scale`, MLA's softmax scale times `softmax_mscale` squared (docs/mla.md)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """YaRN: `attention_factor` if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
        are set (1.0 when equal, as on DeepSeek-V3), else mscale(factor); 1.0 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """mscale(factor, mscale_all_dim) when mscale_all_dim is set, else 1.0: MLA's whole q.k softmax scale is
        multiplied by it twice (DeepSeek-V2's reference and transformers' `yarn_apply_mscale`)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim)


class KVShape(NamedTuple):
    """The paged KV cache per token and layer: num_heads x head_dim; `latent`: one store, V reads return K."""

    num_heads: int
    head_dim: int
    latent: bool


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder; head counts per layer, sizes in elements. Relatives' flags: `qk_norm` (RMSNorm per q/k
    head after the bias, before RoPE), `rotary_dim` (RoPE over the first dims only; None: all), `rope_interleaved`
    (pairs (2i, 2i+1), permuted at load), `post_norms` (GLM-4-0414: RMSNorm on each sublayer's output), `moe`, `mla`
    (MLA attention; head_dim is then the rope head dim, as transformers' attribute_map has it), `sliding_window` (the
    checkpoint's declared window, never applied: sliding_window.check_window refuses one that can bind)."""

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
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None
    sliding_window: SlidingWindow | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only silu / SwiGLU)")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]")

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_shape(self) -> KVShape:
        """MLA caches the latent and the rope key as one head (absorbed attention reads V from it)."""
        if self.mla is not None:
            return KVShape(1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, True)
        return KVShape(self.num_kv_heads, self.head_dim, False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Normalise a transformers config.json dict (4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = (cfg.get("architectures") or [cfg.get("model_type", "llama")])[0]
        family = _FAMILIES.get(arch) or _FAMILIES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"unsupported architecture {arch!r}")
        num_heads = cfg["num_attention_heads"]
        mla = mla_from_hf(family, cfg)
        head_dim = mla.qk_rope_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        rope_scaling = _rope_scaling(scaling, cfg.get("max_position_embeddings", 2048))
        if rope_scaling is not None and rope_scaling.rope_type == "yarn" and mla is None:
            raise ValueError(f"rope scaling 'yarn' is supported for MLA models only (glm4_moe_lite, glm_moe_dsa, "
                             f"deepseek_v32), not {family}")
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
            rope_scaling=rope_scaling, bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids, hidden_act=cfg.get("hidden_act", "silu"),
            qkv_bias=attention_bias or family == "qwen2", o_bias=attention_bias and not glm,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm", False)),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            rope_interleaved=family in ("glm", "glm4") or bool(
                mla and (family in DSA_FAMILIES or cfg.get("rope_interleave", True))),   # DSA: always (HF)
            post_norms=family == "glm4", moe=moe_from_hf(family, cfg), mla=mla, dsa=dsa_from_hf(family, cfg),
            sliding_window=window_from_hf(cfg, cfg["num_hidden_layers"]))

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        """Normalise GGUF metadata as llama.cpp reads it (MTP layers not counted); ValueError naming what is unsupported."""
        arch = meta["general.architecture"]
        family = GGUF_FAMILIES.get(arch)
        if family is None:
            raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(sorted(GGUF_FAMILIES))})")

        def get(key: str, default: Any = _REQUIRED) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is _REQUIRED:
                raise ValueError(f"GGUF architecture {arch!r}: metadata lacks {arch}.{key}")
            return value

        if get("rope.dimension_sections", None) is not None:
            raise ValueError(f"GGUF architecture {arch!r}: M-RoPE (rope.dimension_sections, the vision "
                             "models' RoPE) is not supported")
        if arch == "deepseek2" and (get("attention.indexer.top_k", None) is not None
                                    or any(".indexer." in n for n in tensor_names)):
            raise ValueError("GGUF architecture 'deepseek2' with a DSA indexer (DeepSeek-V3.2): the gguf library "
                             "maps indexer tensors only for 'glm-dsa' (GLM-5's interleaved indexer RoPE), so "
                             "DeepSeek-V3.2's half-split indexer has no GGUF form; serve its HF checkpoint")
        if get("rope.scaling.type", "none") == "yarn":
            raise ValueError(f"GGUF architecture {arch!r}: rope scaling 'yarn' is not read from GGUF metadata; "
                             "serve the HF checkpoint (its config.json rope_scaling)")
        num_heads, hidden = get("attention.head_count"), get("embedding_length")
        num_layers = get("block_count") - get("nextn_predict_layers", 0)
        mla = mla_from_gguf(family, get)
        head_dim = mla.qk_rope_head_dim if mla else get("attention.key_length", hidden // num_heads)
        rotary_dim = get("rope.dimension_count", head_dim)
        scaling = None
        if get("rope.scaling.type", "none") not in ("none", None):
            scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0),
                       "original_max_position_embeddings": get("rope.scaling.original_context_length", None)}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = get("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", ()))

        def has(part: str) -> bool:
            return f"blk.0.{part}" in tensor_names

        # MLA has no KV heads: llama.cpp's head_count_kv 1 is its MQA view of the latent; transformers says num_heads.
        return cls(
            architecture=family, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=get("feed_forward_length"), num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=(None if mla else get("attention.head_count_kv", None)) or num_heads,
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling=_rope_scaling(scaling, get("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            qkv_bias=any(has(f"{p}.bias") for p in ("attn_q", "attn_qkv", "attn_q_a", "attn_kv_a_mqa")),
            o_bias=has("attn_output.bias"),
            mlp_bias=has("ffn_down.bias"), qk_norm=has("attn_q_norm.weight"),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            rope_interleaved=family in ("glm", "glm4") or mla is not None, post_norms=family == "glm4",
            moe=moe_from_gguf(arch, family, get, num_layers), mla=mla,
            dsa=dsa_from_gguf(family, get, num_layers, tensor_names),
            sliding_window=window_from_gguf(get, arch, num_layers))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"]) if d["rope_scaling"] else None
        if d.get("moe"):
            d["moe"] = MoEConfig(**{**d["moe"], "dense_layers": tuple(d["moe"]["dense_layers"])})
        if d.get("mla"):
            d["mla"] = MLAConfig(**d["mla"])
        if d.get("dsa"):
            d["dsa"] = DSAConfig(**{**d["dsa"], "full_layers": tuple(d["dsa"]["full_layers"])})
        if window := d.get("sliding_window"):
            d["sliding_window"] = SlidingWindow(**{**window, "layers": tuple(window["layers"])})
        return cls(**d)


def _rope_scaling(d: dict[str, Any] | None, max_position_embeddings: int) -> RopeScaling | None:
    """Map a rope-scaling dict to RopeScaling (yarn's defaults and its factor from the context ratio when null, as
    transformers' `_compute_yarn_parameters`); raises ValueError for types we do not implement."""
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default", "none"):
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn for MLA)")
    original = d.get("original_max_position_embeddings")
    if kind != "yarn":
        return RopeScaling(rope_type=kind, factor=float(d.get("factor", 1.0)),
                           low_freq_factor=float(d.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(d.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=original)
    if original is None:
        raise ValueError("rope scaling 'yarn' needs original_max_position_embeddings")
    factor = d.get("factor")

    def optional(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return RopeScaling(rope_type="yarn", factor=float(max_position_embeddings / original if factor is None else factor),
                       original_max_position_embeddings=int(original),
                       beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                       mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                       attention_factor=optional("attention_factor"), truncate=bool(d.get("truncate", True)))
