"""Read GGUF files: metadata, and tensors dequantized to fp32 under transformers' names (cached on disk).

llama.cpp's converter permutes the rows of Llama's q/k projections for its interleaved RoPE
layout; `_unpermute` undoes it exactly as transformers' GGUF loader does
(`LlamaTensorProcessor._reverse_permute_weights`), so the tensors equal what
`from_pretrained(..., gguf_file=...)` loads. Dequantizing takes seconds, so the fp32 result and
the ModelConfig are cached as one safetensors file keyed by the GGUF's path, size and mtime.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

_CACHE_VERSION = "1"
_BIG_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
               "tokenizer.ggml.merges"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def cache_dir() -> str:
    """$RADIXSERVE_CACHE_DIR or ~/.cache/radixserve: where dequantized GGUF weights are kept."""
    return os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def cache_path(gguf_path: str) -> str:
    """Cache file of one GGUF file, keyed by its absolute path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_dir(), "gguf", f"{stem}-{digest}.safetensors")


def hf_name(gguf_name: str) -> str | None:
    """transformers' parameter name of a GGUF tensor, or None for tensors we do not load."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if base == "rope_freqs":
        raise NotImplementedError("GGUF rope_freqs (llama3 frequency factors) is not supported yet")
    return None


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation: rows (heads, D/2, 2) -> (heads, 2, D/2)."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _metadata(reader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _BIG_ARRAYS:
            meta[key + ".count"] = len(field.data)
            continue
        meta[key] = field.contents()
    if "tokenizer.ggml.tokens.count" in meta:
        meta.setdefault("tokenizer.ggml.tokens", range(meta["tokenizer.ggml.tokens.count"]))
    return meta


def _dequantized(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf(_metadata(reader), has_output_weight="output.weight" in names)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            logger.warning("skipping GGUF tensor %s", t.name)
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C", copy=True)
        w = torch.from_numpy(array).reshape(shape)
        if config.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        tensors[name] = w.contiguous()
    return config, tensors


def _write_cache(path: str, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    target = cache_path(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        save_file(tensors, tmp, metadata={"model_config": config.to_json(), "source": os.path.abspath(path)})
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old state or the whole file
    except OSError as exc:
        logger.warning("could not cache dequantized GGUF weights at %s: %s", target, exc)
        if os.path.exists(tmp):
            os.remove(tmp)


def load_gguf(path: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """ModelConfig and an iterator of (transformers name, fp32 tensor) for a .gguf file.

    Uses the on-disk cache when present; otherwise dequantizes everything and writes it.
    """
    cached = cache_path(path)
    if os.path.exists(cached):
        with safe_open(cached, framework="pt") as f:
            config = ModelConfig.from_json(f.metadata()["model_config"])
        return config, _iter_cached(cached)
    logger.info("first run: dequantizing GGUF %s to fp32, cached for next time in %s",
                os.path.basename(path), cached)
    config, tensors = _dequantized(path)
    _write_cache(path, config, tensors)
    return config, iter(tensors.items())


def _iter_cached(cached: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(cached, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
