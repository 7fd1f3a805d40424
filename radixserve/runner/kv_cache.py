"""The paged KV cache: one K and one V tensor per layer, shaped [num_pages, page_size, num_kv_heads, head_dim].

Storage is head-major: each layer's K lives in a contiguous `(num_kv_heads, num_pages,
page_size, head_dim)` buffer and `k_cache(layer)` is its permuted view with the contract's
shape. Why: decode attention gathers a sequence's pages per KV head; head-major storage makes
every gathered head a contiguous (tokens, head_dim) matrix, which SDPA reads ~1.5x faster
than the token-major layout on CPU (measured, B=32 x 512 tokens).

    slot = page_id * page_size + offset      (a token's KV position in `flat` views)
"""
from __future__ import annotations

import torch


class KVCache:
    """K/V storage for `num_layers` layers. Zero-initialised: padding reads stay finite."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        self.k_store = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_store = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V bytes one token occupies over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer K as [num_pages, page_size, num_kv_heads, head_dim] (a view; writes go through)."""
        return self.k_store[layer].permute(1, 2, 0, 3)

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer V as [num_pages, page_size, num_kv_heads, head_dim] (a view; writes go through)."""
        return self.v_store[layer].permute(1, 2, 0, 3)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: (T, KV, D) at `slots`: (T,) int64."""
        flat = (self.num_kv_heads, self.num_pages * self.page_size, self.head_dim)
        self.k_store[layer].view(flat).index_copy_(1, slots, k.transpose(0, 1))
        self.v_store[layer].view(flat).index_copy_(1, slots, v.transpose(0, 1))
