"""How the KV cache is sized: its stored dtype and its number of pages."""
from __future__ import annotations

import torch

from radixserve.config_checks import check_history_split, token_history_split
from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.attention.sparse import index_bytes_per_token
from radixserve.runner.kv_cache import FP8_DTYPES, KVCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_DTYPES = {**DTYPES, **FP8_DTYPES}


def kv_storage_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's stored dtype: --kv-cache-dtype, or the compute dtype for auto."""
    return DTYPES[config.dtype] if config.kv_cache_dtype == "auto" else KV_DTYPES[config.kv_cache_dtype]


def index_key_layers(mc: ModelConfig, num_layers: int | None = None) -> tuple[int, ...]:
    """The stored layers with DSA index keys: the model's full indexer layers, and the NextN draft's layer N (its DSA
    block runs a full indexer, models/nextn.py) when `num_layers` (stored) is N + 1."""
    return mc.dsa.full_layers + tuple(range(mc.num_layers, num_layers or mc.num_layers))


def num_pages(config: EngineConfig, mc: ModelConfig, num_kv_heads: int | None = None,
               num_layers: int | None = None, index_layers: tuple[int, ...] | None = None) -> int:
    """The KV cache's pages: --max-total-tokens, else --kv-cache-memory-gb over the bytes per token (every stored layer,
    index keys included). `num_kv_heads`: this rank's under TP (None: the model's); `num_layers`: of KV stored (None:
    the model's); `index_layers`: with index keys (None: index_key_layers); ValueError below two pages."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens // config.page_size
    per_token = _bytes_per_token(mc, kv_storage_dtype(config), num_kv_heads, num_layers) + \
        _index_bytes_per_token(config, mc, num_layers, index_layers)
    pages = int(config.kv_cache_memory_gb * 2**30) // (per_token * config.page_size)
    if pages < 2:
        raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds fewer than two pages")
    return pages


def history_split(config: EngineConfig, mc: ModelConfig, num_kv_heads: int | None = None,
                  num_layers: int | None = None) -> tuple[int, int]:
    """--kv-history-dtype auto: (model-dtype pages, FP8 pages), config_checks.token_history_split for a token-sized
    pool; else F = --kv-fp8-page-fraction of B = --kv-cache-memory-gb: fp8 = floor(F * B) // (fp8 page bytes), model
    = (B - floor(F * B)) // (model-dtype page bytes), index keys in both. ValueError: check_history_split."""
    page, fraction = config.page_size, config.kv_fp8_page_fraction
    if config.max_total_tokens is not None:
        split = token_history_split(config.max_total_tokens // page, fraction)
    else:
        budget = int(config.kv_cache_memory_gb * 2**30)
        fp8_budget = int(budget * fraction)
        index = _index_bytes_per_token(config, mc, num_layers)    # DSA index keys: the same bytes in both ranges
        split = tuple((part // ((_bytes_per_token(mc, dtype, num_kv_heads, num_layers) + index) * page))
                      for part, dtype in ((budget - fp8_budget, DTYPES[config.dtype]),
                                          (fp8_budget, KV_DTYPES[config.kv_cache_dtype])))
    check_history_split(split)
    return split


def _bytes_per_token(mc: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None, num_layers: int | None) -> int:
    heads, head_dim, latent = mc.kv_shape
    heads = heads if latent or num_kv_heads is None else num_kv_heads
    return KVCache.bytes_per_token(num_layers or mc.num_layers, heads, head_dim, dtype, latent)


def _index_bytes_per_token(config: EngineConfig, mc: ModelConfig, num_layers: int | None,
                           index_layers: tuple[int, ...] | None = None) -> int:
    """DSA index-key bytes per token over every stored layer that keeps them (0 without DSA)."""
    if mc.dsa is None:
        return 0
    layers = index_key_layers(mc, num_layers) if index_layers is None else index_layers
    return index_bytes_per_token(layers, mc.dsa.index_head_dim, DTYPES[config.dtype],
                                 config.index_cache_dtype != "auto")
