"""MixedKVCache: one page-id space over a model-dtype KVCache and an FP8 one (--kv-history-dtype auto, docs/runner.md).

    page ids [0, num_model_pages)          -> `model`, page p
    page ids [num_model_pages, num_pages)  -> `fp8`, page p - num_model_pages

PagePool hands prompt pages from the first range and decode pages from the second (the tree holds model-dtype KV
only). Reads and writes split global slots by range; side buffers (DSA index keys) are one store over every slot."""
from __future__ import annotations

import torch

from radixserve.runner.kv_cache import KVCache


class MixedKVCache:
    """The KVCache surface the torch attention backend, its DecodeMirror and the sparse backend use (write, head_rows,
    gather, round_trip by slot, read_slots, side buffers) and the sizing accessors. Host tier, PD export/import, kernel
    views and checksums are not offered: the flags needing them are refused at start-up (config_checks.check_kv_history)."""

    def __init__(self, model: KVCache, fp8: KVCache):
        assert not model.is_fp8 and fp8.is_fp8, "model must store the model dtype and fp8 an FP8 dtype"
        assert (model.num_layers, model.page_size, model.num_kv_heads, model.head_dim, model.latent) == \
            (fp8.num_layers, fp8.page_size, fp8.num_kv_heads, fp8.head_dim, fp8.latent), "layouts differ"
        self.model, self.fp8 = model, fp8
        self.num_layers, self.page_size, self.latent = model.num_layers, model.page_size, model.latent
        self.num_kv_heads, self.head_dim, self.device = model.num_kv_heads, model.head_dim, model.device
        self.compute_dtype = model.compute_dtype
        self.num_model_pages = model.num_pages
        self.num_pages = model.num_pages + fp8.num_pages
        self.dtype, self.history_dtype = fp8.dtype, model.dtype
        self.k_scale, self.v_scale = fp8.k_scale, fp8.v_scale
        self._head_offsets = torch.arange(self.num_kv_heads, device=self.device) * self.num_pages
        # Side buffers only: a KVCache with no KV heads over the global page-id space (its K/V hold 0 bytes).
        self._sides = KVCache(self.num_layers, self.num_pages, self.page_size, 0, self.head_dim, model.dtype,
                              self.device)

    @classmethod
    def build(cls, num_layers: int, num_model_pages: int, num_fp8_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, fp8_dtype: torch.dtype, device: torch.device, compute_dtype: torch.dtype,
              k_scale: torch.Tensor, v_scale: torch.Tensor, latent: bool = False) -> MixedKVCache:
        """History pages store `compute_dtype`; FP8 pages `fp8_dtype` with k_scale, v_scale (layers, KV) fp32."""
        shape = (num_layers, page_size, num_kv_heads, head_dim)
        model = KVCache(shape[0], num_model_pages, *shape[1:], compute_dtype, device, latent=latent)
        fp8 = KVCache(shape[0], num_fp8_pages, *shape[1:], fp8_dtype, device, compute_dtype, k_scale, v_scale,
                      latent=latent)
        return cls(model, fp8)

    def bytes_per_page(self) -> tuple[int, int]:
        """Stored bytes of one model-dtype page and of one FP8 page, all layers."""
        return self.model.token_bytes * self.page_size, self.fp8.token_bytes * self.page_size

    @property
    def slot_bytes(self) -> int:
        """Mean stored bytes per token slot over both ranges (the pool's bytes / its slots)."""
        return self.allocated_bytes() // (self.num_pages * self.page_size)

    def allocated_bytes(self) -> int:
        return self.model.allocated_bytes() + self.fp8.allocated_bytes() + self._sides.allocated_bytes()

    def add_side_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                        layers: list[int] | None = None) -> None:
        """KVCache.add_side_buffer over every global slot."""
        self._sides.add_side_buffer(name, shape, dtype, layers)

    @property
    def side_names(self) -> list[str]:
        return self._sides.side_names

    def side_layers(self, name: str) -> list[int]:
        return self._sides.side_layers(name)

    def side_export(self, name: str, num_pages: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self._sides.side_export(name, num_pages)

    def write_side(self, name: str, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        self._sides.write_side(name, layer, slots, x)

    def read_side(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self._sides.read_side(name, layer, slots)

    def read_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K at global `slots` (T,) int64 as (T, KV, D) compute dtype, FP8 rows dequantised (sparse attention)."""
        boundary = self.num_model_pages * self.page_size
        in_fp8 = slots >= boundary
        if not bool(in_fp8.any()):
            return self.model.read_slots(layer, slots)
        out = torch.empty((slots.numel(), self.num_kv_heads, self.head_dim), dtype=self.compute_dtype,
                          device=self.device)
        on_model = ~in_fp8
        if bool(on_model.any()):
            out[on_model] = self.model.read_slots(layer, slots[on_model])
        out[in_fp8] = self.fp8.read_slots(layer, slots[in_fp8] - boundary)
        return out

    def is_fp8_page(self, page_id: int) -> bool:
        return page_id >= self.num_model_pages

    def wait_ready(self, layer: int, side: bool = False) -> None:
        self.model.wait_ready(layer, side)
        self.fp8.wait_ready(layer, side)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (T, KV, D) compute dtype at global `slots` (T,) int64, quantised in FP8 pages."""
        boundary = self.num_model_pages * self.page_size
        in_fp8 = slots >= boundary
        if not bool(in_fp8.any()):
            self.model.write(layer, slots, k, v)
            return
        on_model = ~in_fp8
        if bool(on_model.any()):
            self.model.write(layer, slots[on_model], k[on_model], v[on_model])
        self.fp8.write(layer, slots[in_fp8] - boundary, k[in_fp8], v[in_fp8])

    round_trip_by_slot = True

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (T, KV, D) as a later read of `slots` (T,) int64 returns them: rows in FP8 pages quantised and back.
        slots None: a prefill without cached context, which writes model-dtype pages only: k, v unchanged."""
        in_fp8 = None if slots is None else slots >= self.num_model_pages * self.page_size
        if in_fp8 is None or not bool(in_fp8.any()):
            return k, v
        k_fp8, v_fp8 = self.fp8.round_trip(layer, k[in_fp8], v[in_fp8])
        k, v = k.clone(), v.clone()
        k[in_fp8], v[in_fp8] = k_fp8, v_fp8
        return k, v

    def head_rows(self, page_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 global page ids -> (KV * n,) int64 head-major rows over all num_pages (KVCache.head_rows)."""
        return (self._head_offsets[:, None] + page_ids[None, :]).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from head_rows (R,) -> K, V (R, page_size * D) compute dtype (into k_out / v_out if given), FP8 pages
        dequantised; latent: V is the returned K."""
        head, page = rows // self.num_pages, rows % self.num_pages
        in_fp8 = page >= self.num_model_pages
        model_rows = head * self.num_model_pages + page
        if not bool(in_fp8.any()):
            return self.model.gather(layer, model_rows, k_out, v_out)
        fp8_idx, model_idx = in_fp8.nonzero().view(-1), (~in_fp8).nonzero().view(-1)
        fp8_rows = (head * self.fp8.num_pages + page - self.num_model_pages).index_select(0, fp8_idx)
        parts = (self.model.gather(layer, model_rows.index_select(0, model_idx)),
                 self.fp8.gather(layer, fp8_rows))
        shape = (rows.numel(), self.page_size * self.head_dim)
        out = []
        for i, buf in enumerate((k_out, v_out)[:1 if self.latent else 2]):
            buf = buf if buf is not None else torch.empty(shape, dtype=self.compute_dtype, device=self.device)
            buf.index_copy_(0, model_idx, parts[0][i])
            buf.index_copy_(0, fp8_idx, parts[1][i])
            out.append(buf)
        return out[0], out[-1]

    def read_pages(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of global `page_ids` (n,) int64 as (KV, n * page_size, D) compute dtype."""
        k, v = self.gather(layer, self.head_rows(page_ids))
        shape = (self.num_kv_heads, -1, self.head_dim)
        return k.view(shape), v.view(shape)

    def stored_pages(self, page_ids: list[int]) -> list[tuple[torch.dtype, torch.Tensor]]:
        """Per global page id: its store's dtype and its stored K of layer 0, (KV, page_size, D) (tests, inspection)."""
        out = []
        for p in page_ids:
            cache, local = (self.fp8, p - self.num_model_pages) if self.is_fp8_page(p) else (self.model, p)
            out.append((cache.dtype, cache.export_pages([local]).k[0, :, 0]))
        return out
