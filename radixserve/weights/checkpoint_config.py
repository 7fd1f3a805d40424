"""A checkpoint's ModelConfig and what it refuses, read without torch, so `radixserve serve` checks them at start-up."""
from __future__ import annotations

import logging
from typing import Any

from radixserve.config_checks import check_model_fit
from radixserve.engine_config import EngineConfig
from radixserve.models.block_config import check_nextn_family
from radixserve.models.model_config import ModelConfig
from radixserve.weights.paths import is_gguf
from radixserve.weights.safetensors import read_hf_config

logger = logging.getLogger(__name__)
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


def resolve_quantization(quantization: str, path: str, deterministic: bool = False) -> str:
    """"none", "int4", "int8", "int4-int8" or "int4-fp32"; auto: int4 for a GGUF file, else (and when deterministic) none. Raises
    ValueError for a quantized mode on an HF folder (only GGUF weights are read quantized)."""
    if quantization == "auto":
        if deterministic and is_gguf(path):
            logger.info("--quantization auto: serving unquantized, because the int4 kernel is not "
                        "proven batch-invariant for --enable-deterministic-inference")
        return "int4" if is_gguf(path) and not deterministic else "none"
    if quantization != "none" and not is_gguf(path):
        raise ValueError(f"--quantization {quantization} reads GGUF blocks; {path!r} is not a .gguf file "
                         f"(serve it with --quantization none or auto)")
    return quantization


def check_checkpoint(config: EngineConfig, path: str) -> None:
    """ValueError naming the flag: a --quantization mode, (config_checks.check_model_fit) a size, or EAGLE on a
    checkpoint without a NextN layer and no draft head file, that `path` refuses."""
    resolve_quantization(config.quantization, path, config.enable_deterministic_inference)
    eagle_on_checkpoint = config.is_eagle and config.speculative_draft_model_path is None
    if config.pp_size > 1 or config.tp_size > 1 or eagle_on_checkpoint:
        model_config = read_model_config(path)
        check_model_fit(config, model_config)
        if eagle_on_checkpoint:
            check_nextn_family(model_config.architecture)
