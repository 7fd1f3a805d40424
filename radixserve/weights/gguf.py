"""Read GGUF files: metadata, and tensors under transformers' names, dequantized to fp32 (cached on disk) or kept int4.

Llama q/k rows are unpermuted as transformers' `_reverse_permute_weights` does; each variant has its own cache file."""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve.config import cache_root
from radixserve.layers.quant_linear import Int4F32Weight, Int4Int8Weight, Int4Weight, Int8Weight, QuantWeight
from radixserve.models.model_config import ModelConfig
from radixserve.weights.checkpoint_config import read_gguf
from radixserve.weights.gguf_blocks import INT4_TYPES, decode_int4
from radixserve.weights.gguf_names import FP32_ONLY, Piece, hf_pieces, merge_kv_b

logger = logging.getLogger(__name__)

_CACHE_VERSION = "4"   # bumped whenever the ModelConfig or the tensors derived from a file change


def cache_path(gguf_path: str, variant: str = "") -> str:
    """Keyed by the file's absolute path, size and mtime; `variant`: "" (fp32), "int4" or "int8"."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0] + (f".{variant}" if variant else "")
    return os.path.join(cache_root(), "gguf", f"{stem}-{digest}.safetensors")


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation: rows (heads, D/2, 2) -> (heads, 2, D/2)."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _mapped_tensors(config: ModelConfig, reader) -> Iterator[tuple[list[Piece], Any]]:
    for t in reader.tensors:
        pieces = hf_pieces(config, t.name)
        if pieces:
            yield pieces, t


def _unpermuted(config: ModelConfig, name: str, w):
    if config.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return w
    num_heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    if isinstance(w, Int4Weight):
        return w.take_rows(_unpermute(torch.arange(w.shape[0]), num_heads))
    return _unpermute(w, num_heads).contiguous()


def _cut(config: ModelConfig, pieces: list[Piece], w) -> Iterator[tuple[str, Any]]:
    """(name, part of `w`) per piece, the q/k permutation undone; a quantized weight is cut by row ranges only."""
    for name, index in pieces:
        if index is None:
            part = w
        elif isinstance(w, torch.Tensor):
            part = w[index].contiguous()
        else:
            part = w.take_rows(torch.arange(w.shape[0])[index])
        yield name, _unpermuted(config, name, part)


def _fp32(t) -> torch.Tensor:
    """GGUF tensor `t` dequantized, in transformers' dimension order (GGUF lists them reversed)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(t.shape))
    array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C", copy=True)
    return torch.from_numpy(array).reshape(shape)


def _dequantized(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config, reader = read_gguf(path)
    tensors = {name: w for pieces, t in _mapped_tensors(config, reader) for name, w in _cut(config, pieces, _fp32(t))}
    merge_kv_b(tensors)
    return config, tensors


def _quantized(path: str, mode: str) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight]]:
    """"int4": Q4_0 / Q4_1 / Q4_K linear weights as Int4Weight; "int8": every linear weight as Int8Weight.
    Everything else fp32: routed experts (the MoE layer has no quantized kernel), MLA's k_b / v_b halves (3-D; merged
    into kv_b_proj), FP32_ONLY and the NextN layer (weights/nextn_loader.py loads float tensors)."""
    config, reader = read_gguf(path)
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    kept: dict[str, int] = {}
    nextn = f"model.layers.{config.num_layers}."
    for pieces, t in _mapped_tensors(config, reader):
        kind = t.tensor_type.name
        linear = (all((p.name.endswith("_proj.weight") and not p.name.endswith(FP32_ONLY))
                      or p.name == "lm_head.weight" for p in pieces)
                  and not any(isinstance(p.index, int) for p in pieces) and len(t.shape) == 2
                  and not pieces[0].name.startswith(nextn))
        if linear and mode == "int4" and kind in INT4_TYPES:
            w = Int4Weight(*(torch.from_numpy(a) for a in decode_int4(kind, t.data, int(t.shape[0]))))
            tensors.update(_cut(config, pieces, w))
        elif linear and mode == "int8":
            tensors.update((n, Int8Weight.from_float(w)) for n, w in _cut(config, pieces, _fp32(t)))
        else:
            if linear:
                kept[kind] = kept.get(kind, 0) + 1
            tensors.update(_cut(config, pieces, _fp32(t)))
    merge_kv_b(tensors)
    if kept:
        logger.info("%s: linear weights of GGUF type %s have no exact %s mapping; served in fp32", mode,
                    ", ".join(f"{k} ({n})" for k, n in sorted(kept.items())), mode)
    return config, tensors


def _flatten(tensors: dict[str, torch.Tensor | QuantWeight]) -> dict[str, torch.Tensor]:
    """Int4Weight n -> n#codes (two a byte, low nibble first), n#scale, n#zero; Int8Weight n -> n#values, n#scale."""
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if isinstance(t, Int4Weight):
            flat[f"{name}#codes"] = t.codes[:, 0::2] | (t.codes[:, 1::2] << 4)
            flat[f"{name}#scale"], flat[f"{name}#zero"] = t.scale, t.zero
        elif isinstance(t, Int8Weight):
            flat[f"{name}#values"], flat[f"{name}#scale"] = t.values, t.scale
        else:
            flat[name] = t
    return flat


def _write_cache(path: str, config: ModelConfig, tensors: dict[str, torch.Tensor], target: str) -> None:
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        save_file(tensors, tmp, metadata={"model_config": config.to_json(), "source": os.path.abspath(path)})
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old state or the whole file
    except OSError as exc:
        logger.warning("could not cache GGUF weights at %s: %s", target, exc)
        if os.path.exists(tmp):
            os.remove(tmp)


def load_gguf(path: str, quantization: str = "none") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | QuantWeight]]]:
    """ModelConfig and (transformers name, tensor or quantized weight) pairs, from the variant's cache or cached now."""
    own_kernel = {"int4-int8": Int4Int8Weight, "int4-fp32": Int4F32Weight}.get(quantization)
    if own_kernel is not None:   # int4's weights and cache, served by radixserve's own kernel
        config, tensors = load_gguf(path, "int4")
        return config, ((n, own_kernel(t.codes, t.scale, t.zero) if isinstance(t, Int4Weight) else t)
                        for n, t in tensors)
    quantized = quantization != "none"
    cached = cache_path(path, quantization if quantized else "")
    if os.path.exists(cached):
        with safe_open(cached, framework="pt") as f:
            config = ModelConfig.from_json(f.metadata()["model_config"])
        return config, _iter_cached(cached)
    logger.info("first run: %s GGUF %s to %s, cached for next time in %s",
                "converting" if quantized else "dequantizing", os.path.basename(path),
                quantization if quantized else "fp32", cached)
    config, tensors = _quantized(path, quantization) if quantized else _dequantized(path)
    _write_cache(path, config, _flatten(tensors), cached)
    return config, iter(tensors.items())


def _iter_cached(cached: str) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    with safe_open(cached, framework="pt") as f:
        for name in f.keys():
            base, _, part = name.partition("#")
            if part == "codes":
                packed = f.get_tensor(name)
                codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1)
                yield base, Int4Weight(codes, f.get_tensor(f"{base}#scale"), f.get_tensor(f"{base}#zero"))
            elif part == "values":
                yield base, Int8Weight(f.get_tensor(name), f.get_tensor(f"{base}#scale"))
            elif not part:
                yield name, f.get_tensor(name)
