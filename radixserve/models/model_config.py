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
}


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
class ModelConfig:
    """Shapes and options of a Llama-family decoder. Head counts are per layer; sizes in elements.

    Flags let relatives reuse the Llama decoder: `qkv_bias` (Qwen2), `qk_norm` (Qwen3:
    RMSNorm over each head of q and k before RoPE), `o_bias` / `mlp_bias` (Llama's
    attention_bias / mlp_bias options).
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only silu / SwiGLU)")

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
        attention_bias = bool(cfg.get("attention_bias", False))
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
            qkv_bias=attention_bias or family == "qwen2", o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=family == "qwen3")

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
        return cls(**d)


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
