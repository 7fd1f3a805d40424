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
        self._head_offsets = torch.arange(num_kv_heads, device=device) * num_pages

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

    def head_rows(self, page_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 page ids -> (KV * n,) int64 rows of the `(KV * num_pages, page_size * D)`
        view, head-major: all pages of head 0, then head 1, ..."""
        return (self._head_offsets[:, None] + page_ids[None, :]).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole pages: rows from `head_rows` -> K and V, each (len(rows), page_size * D).

        A row gather over a 2-D view is a plain memcpy per page, about 2x faster on CPU
        than index_select along the page dim of the 4-D store."""
        flat = (self.num_kv_heads * self.num_pages, self.page_size * self.head_dim)
        k = torch.index_select(self.k_store[layer].view(flat), 0, rows, out=k_out)
        v = torch.index_select(self.v_store[layer].view(flat), 0, rows, out=v_out)
        return k, v
