"""How the KV cache is sized: its stored dtype and its number of pages."""
from __future__ import annotations

import torch

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
               num_layers: int | None = None) -> int:
    """Pages of `config.page_size` tokens the KV cache gets: --max-total-tokens, else --kv-cache-memory-gb over the bytes
    per token (every stored layer, index keys included). `num_kv_heads`: this rank's under TP (None: the model's);
    `num_layers`: of KV stored (None: the model's). Raises ValueError below two pages."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens // config.page_size
    per_token = _bytes_per_token(mc, kv_storage_dtype(config), num_kv_heads, num_layers) + \
        _index_bytes_per_token(config, mc, num_layers)
    pages = int(config.kv_cache_memory_gb * 2**30) // (per_token * config.page_size)
    if pages < 2:
        raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds fewer than two pages")
    return pages


def history_split(config: EngineConfig, mc: ModelConfig, num_kv_heads: int | None = None,
                  num_layers: int | None = None) -> tuple[int, int]:
    """--kv-history-dtype auto: (model-dtype pages, FP8 pages). With --max-total-tokens its pages split by
    --kv-fp8-page-fraction; else that fraction F of B = --kv-cache-memory-gb bytes goes to FP8 pages:
    fp8 = floor(F * B) // (fp8 bytes per page), model = (B - floor(F * B)) // (model-dtype bytes per page), DSA index
    keys counted in both. Raises ValueError when either range gets no page or the history fewer than two."""
    page, fraction = config.page_size, config.kv_fp8_page_fraction
    if config.max_total_tokens is not None:
        total = config.max_total_tokens // page
        fp8 = round(total * fraction)
        split = (total - fp8, fp8)
    else:
        budget = int(config.kv_cache_memory_gb * 2**30)
        fp8_budget = int(budget * fraction)
        index = _index_bytes_per_token(config, mc, num_layers)    # DSA index keys: the same bytes in both ranges
        split = tuple((part // ((_bytes_per_token(mc, dtype, num_kv_heads, num_layers) + index) * page))
                      for part, dtype in ((budget - fp8_budget, DTYPES[config.dtype]),
                                          (fp8_budget, KV_DTYPES[config.kv_cache_dtype])))
    if split[0] < 2 or split[1] < 1:
        raise ValueError(f"--kv-history-dtype auto: the KV pool splits into {split[0]} history and {split[1]} fp8 "
                         f"pages; it needs at least 2 and 1 (raise the pool size or change --kv-fp8-page-fraction)")
    return split


def _bytes_per_token(mc: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None, num_layers: int | None) -> int:
    heads, head_dim, latent = mc.kv_shape
    heads = heads if latent or num_kv_heads is None else num_kv_heads
    return KVCache.bytes_per_token(num_layers or mc.num_layers, heads, head_dim, dtype, latent)


def _index_bytes_per_token(config: EngineConfig, mc: ModelConfig, num_layers: int | None) -> int:
    """DSA index-key bytes per token over every stored layer that keeps them (0 without DSA)."""
    if mc.dsa is None:
        return 0
    return index_bytes_per_token(index_key_layers(mc, num_layers), mc.dsa.index_head_dim, DTYPES[config.dtype],
                                 config.index_cache_dtype != "auto")
