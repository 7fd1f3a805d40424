"""A checkpoint's ModelConfig and what it refuses, read without torch, so `radixserve serve` checks them at start-up."""
from __future__ import annotations

import logging
from typing import Any

from radixserve.config_checks import check_model_fit
from radixserve.engine_config import EngineConfig
from radixserve.models.block_config import check_nextn_family
from radixserve.models.model_config import GGUF_FAMILIES, ModelConfig
from radixserve.models.sliding_window import check_window
from radixserve.weights.paths import is_gguf
from radixserve.weights.safetensors import read_hf_config

logger = logging.getLogger(__name__)

# --quantized-max-tokens under --quantization auto, by the int4-fp32 kernel's path (layers/int4_fp32.chosen_isa):
# the largest step it beats oneDNN's fp32 GEMM on its copy (docs/benchmarks.md, "int4-fp32 rows by ISA").
AUTO_QUANTIZED_MAX_TOKENS = {"avx512": 16, "avx2": 8}
_BIG_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
               "tokenizer.ggml.merges"}


def _gguf_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _BIG_ARRAYS:
            meta[key + ".count"] = len(field.data)
            continue
        meta[key] = field.contents()
    if "tokenizer.ggml.tokens.count" in meta:
        meta.setdefault("tokenizer.ggml.tokens", range(meta["tokenizer.ggml.tokens.count"]))
    return meta


def read_gguf(path: str) -> tuple[ModelConfig, Any]:
    """The ModelConfig of a .gguf file and its open gguf.GGUFReader; ValueError naming what is unsupported."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return ModelConfig.from_gguf(_gguf_metadata(reader), {t.name for t in reader.tensors}), reader


def read_model_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF folder's config.json or a GGUF file's metadata; ValueError if unsupported or lacking."""
    try:
        return read_gguf(path)[0] if is_gguf(path) else ModelConfig.from_hf(read_hf_config(path))
    except KeyError as exc:
        raise ValueError(f"model path {path!r}: its config lacks {exc}") from None
    except TypeError as exc:   # a value of another JSON type than the key takes: "2" layers, a list model_type
        raise ValueError(f"model path {path!r}: its config has a value of the wrong type ({exc})") from None


def resolve_quantization(quantization: str, path: str, own_int4_kernel: bool = False) -> str:
    """"none", "int4", "int8", "int4-int8" or "int4-fp32"; auto: int4-fp32 for a GGUF file where radixserve's int4-fp32
    kernel runs (`own_int4_kernel`: built, on a CPU), else none. Raises ValueError for a quantized mode on an HF folder
    (only GGUF weights are read quantized)."""
    if quantization == "auto":
        if is_gguf(path) and not own_int4_kernel:
            logger.info("--quantization auto: serving fp32, since the int4-fp32 kernel does not run here "
                        "(python -m radixserve.csrc.build builds it; CPU only)")
        return "int4-fp32" if is_gguf(path) and own_int4_kernel else "none"
    if quantization != "none" and not is_gguf(path):
        raise ValueError(f"--quantization {quantization} reads GGUF blocks; {path!r} is not a .gguf file "
                         f"(serve it with --quantization none or auto)")
    return quantization


def resolve_quantized_max_tokens(config: EngineConfig, quantization: str, isa: str | None = None) -> int:
    """--quantized-max-tokens, unset: AUTO_QUANTIZED_MAX_TOKENS[isa] (the int4-fp32 path; avx512's for None or another)
    where --quantization auto chose a quantized mode outside --enable-deterministic-inference (whose rows must not
    change path with the step's size), else 0."""
    if config.quantized_max_tokens is not None:
        return config.quantized_max_tokens
    if config.quantization != "auto" or quantization == "none" or config.enable_deterministic_inference:
        return 0
    return AUTO_QUANTIZED_MAX_TOKENS.get(isa, AUTO_QUANTIZED_MAX_TOKENS["avx512"])


def check_checkpoint(config: EngineConfig, path: str) -> None:
    """ValueError naming the flag or key: a --quantization mode, (config_checks.check_model_fit) a size, a sliding
    window that can bind within the context (sliding_window.check_window), or EAGLE on a checkpoint without a NextN
    layer and no draft head file, that `path` refuses."""
    resolve_quantization(config.quantization, path)
    eagle_on_checkpoint = config.is_eagle and config.speculative_draft_model_path is None
    if config.pp_size > 1 or config.tp_size > 1 or eagle_on_checkpoint or _may_slide(path):
        model_config = read_model_config(path)
        check_model_fit(config, model_config)
        check_window(model_config.sliding_window, config.context_length or model_config.max_position_embeddings)
        if eagle_on_checkpoint:
            check_nextn_family(model_config.architecture)


def _may_slide(path: str) -> bool:
    """False for a GGUF file without `<arch>.attention.sliding_window`, found without GGUFReader (which builds the
    vocabulary arrays: ~2 s on the default model); True for an HF folder (its config.json costs nothing to read)."""
    if not is_gguf(path):
        return True
    from radixserve.weights.gguf_header import read_scalars
    return bool(read_scalars(path, [f"{arch}.attention.sliding_window" for arch in GGUF_FAMILIES]))
