"""KVCache: the one owner of paged K/V storage (layout, dtype incl. FP8 with scales, device) and every read and write of it.

Contract shape per layer: [num_pages, page_size, num_kv_heads, head_dim]; a token's slot is

    slot = page_id * page_size + offset

Storage is head-major: each layer's K lives in a contiguous `(num_kv_heads, num_pages,
page_size, head_dim)` buffer. Why: decode attention gathers a sequence's pages per KV head;
head-major storage makes every gathered head a contiguous (tokens, head_dim) matrix, which
SDPA reads ~1.5x faster than the token-major layout on CPU (measured, B=32 x 512 tokens).

Stored dtype may differ from the compute dtype (`--kv-cache-dtype`). FP8 stores
`clamp(x / scale, ±fp8_max)` cast to float8 with one scale per (layer, KV head); every read
returns `stored * scale` in the compute dtype. Stored values are never rescaled in place.

Readiness: every read passes `wait_ready(layer)`. A layer is ready unless someone filling it
asynchronously (a host-tier load, a prefill->decode transfer) called `begin_fill` and has not
yet called `end_fill` for it; the wait then blocks until it does. Fills nest: with two loads in
flight a layer is ready only when both have ended it (a count per layer, not a flag).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class KVPages:
    """Exported pages, in stored dtype on the CPU, page order as requested.

    k, v: (num_layers, num_kv_heads, n, page_size, head_dim); side: name -> (num_layers, n,
    page_size, *shape) for each side buffer."""

    k: torch.Tensor
    v: torch.Tensor
    side: dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelView:
    """One layer's raw storage for kernels that read pages themselves (KVCache.kernel_view).

    k, v: (num_kv_heads, num_pages, page_size, head_dim) stored dtype, contiguous, on the
    cache's device; a key's value is `k[h, page, offset] * k_scale[h]` (likewise v).
    k_scale, v_scale: (num_kv_heads,) fp32, 1.0 unless the storage is FP8."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


class KVCache:
    """K/V (and side-buffer) storage for `num_layers` layers. Zero-initialised: padding reads stay finite.

    `dtype`: stored dtype (float32, bfloat16, float8_e4m3fn, float8_e5m2); `compute_dtype`:
    what reads return (default: `dtype`). `k_scale`, `v_scale`: (num_layers, num_kv_heads)
    fp32, required for float8 storage, 1.0 otherwise.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.compute_dtype = compute_dtype or dtype
        self.is_fp8 = dtype in FP8_DTYPES.values()
        if self.is_fp8 and (k_scale is None or v_scale is None):
            raise ValueError("float8 KV storage needs k_scale and v_scale")
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._head_offsets = torch.arange(num_kv_heads, device=self.device) * num_pages
        self._fp8_max = torch.finfo(dtype).max if self.is_fp8 else 0.0
        ones = torch.ones(num_layers, num_kv_heads)
        self.k_scale = (k_scale if k_scale is not None else ones).float().to(self.device)
        self.v_scale = (v_scale if v_scale is not None else ones).float().to(self.device)
        self._side: dict[str, list[torch.Tensor]] = {}
        self._ready = [threading.Event() for _ in range(num_layers)]
        for event in self._ready:
            event.set()
        self._filling = [0] * num_layers        # fills in flight per layer (under _fill_lock)
        self._fill_lock = threading.Lock()
        self.skip_readiness_wait = False        # TEST ONLY: reads ignore fills in flight

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V bytes one token occupies over all layers in stored `dtype`."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- readiness -----------------------------------------------------------------------------
    def begin_fill(self, layers: range | list[int]) -> None:
        """Mark `layers` as being filled asynchronously: reads of them block until every fill
        begun on them has called `end_fill`. Call it before the filler starts (on the thread
        that schedules the reads), so no read can slip in between."""
        with self._fill_lock:
            for layer in layers:
                self._filling[layer] += 1
                self._ready[layer].clear()

    def end_fill(self, layer: int) -> None:
        """One asynchronous fill of `layer` has landed (or given up); reads proceed once no
        other fill of it is in flight."""
        with self._fill_lock:
            assert self._filling[layer] > 0, f"end_fill({layer}) without begin_fill"
            self._filling[layer] -= 1
            if self._filling[layer] == 0:
                self._ready[layer].set()

    def wait_ready(self, layer: int) -> None:
        """Block until `layer` is readable (returns at once unless a fill is in flight)."""
        event = self._ready[layer]
        if not event.is_set() and not self.skip_readiness_wait:
            event.wait()

    # ---- writes ------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: (T, KV, D) compute dtype at `slots`: (T,) int64, quantising for FP8."""
        flat = (self.num_kv_heads, self.num_pages * self.page_size, self.head_dim)
        for store, x, scale in ((self._k, k, self.k_scale), (self._v, v, self.v_scale)):
            data = self._encode(x.transpose(0, 1), scale[layer])                 # (KV, T, D)
            target = store[layer].view(flat)
            if self.is_fp8:  # CPU index_copy_ has no float8 kernel: copy the bytes
                target, data = target.view(torch.uint8), data.view(torch.uint8)
            target.index_copy_(1, slots, data)

    def _encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x: (KV, T, D) compute dtype -> stored dtype; scale: (KV,) fp32."""
        if not self.is_fp8:
            return x.to(self.dtype)
        q = x.float() / scale[:, None, None]
        return q.clamp_(-self._fp8_max, self._fp8_max).to(self.dtype)

    def _decode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Stored (KV, ...) -> compute dtype; scale: (KV,) fp32 broadcast over the rest."""
        if not self.is_fp8:
            return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        view = scale.view(-1, *([1] * (x.dim() - 1)))
        return (x.float() * view).to(self.compute_dtype)

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (T, KV, D) as a later read of them will return (identity unless the stored
        dtype is lossy). For caches of caches (DecodeMirror) that must see what the pages hold."""
        if not self.is_fp8 and self.dtype == self.compute_dtype:
            return k, v
        out = []
        for x, scale in ((k, self.k_scale[layer]), (v, self.v_scale[layer])):
            stored = self._encode(x.transpose(0, 1), scale)
            out.append(self._decode(stored, scale).transpose(0, 1))
        return out[0], out[1]

    # ---- reads -------------------------------------------------------------------------------
    def head_rows(self, page_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 page ids -> (KV * n,) int64 rows of the `(KV * num_pages, page_size * D)`
        view, head-major: all pages of head 0, then head 1, ..."""
        return (self._head_offsets[:, None] + page_ids[None, :]).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages in compute dtype: rows from `head_rows` (KV * n,) -> K and V, each
        (KV * n, page_size * D). `k_out`/`v_out` (same shape, compute dtype) are filled when given.

        A row gather over a 2-D view is a plain memcpy per page, about 2x faster on CPU
        than index_select along the page dim of the 4-D store."""
        self.wait_ready(layer)
        flat = (self.num_kv_heads * self.num_pages, self.page_size * self.head_dim)
        out = []
        for store, scale, buf in ((self._k, self.k_scale, k_out), (self._v, self.v_scale, v_out)):
            if not self.is_fp8 and self.dtype == self.compute_dtype:
                out.append(torch.index_select(store[layer].view(flat), 0, rows, out=buf))
                continue
            raw = torch.index_select(store[layer].view(flat), 0, rows)        # (KV * n, S * D)
            deq = self._decode(raw.view(self.num_kv_heads, -1), scale[layer]).view(raw.shape)
            out.append(buf.copy_(deq) if buf is not None else deq)
        return out[0], out[1]

    def read_pages(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `page_ids` (n,) int64 as (KV, n * page_size, D) in compute dtype."""
        k, v = self.gather(layer, self.head_rows(page_ids))
        shape = (self.num_kv_heads, -1, self.head_dim)
        return k.view(shape), v.view(shape)

    def kernel_view(self, layer: int) -> KernelView:
        """`layer`'s raw K/V storage and scales (see KernelView), after its readiness wait.
        For kernels that index pages through the page table themselves; read-only by contract:
        writes go through `write`."""
        self.wait_ready(layer)
        return KernelView(self._k[layer], self._v[layer], self.k_scale[layer], self.v_scale[layer])

    # ---- side buffers (per-slot state a model adds: an indexer cache, extra scales) -----------
    def add_side_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate per-layer storage of `shape` per slot, zeroed: (num_pages, page_size, *shape)."""
        assert name not in self._side, f"side buffer {name!r} exists"
        full = (self.num_pages, self.page_size, *shape)
        self._side[name] = [torch.zeros(full, dtype=dtype, device=self.device)
                            for _ in range(self.num_layers)]

    @property
    def side_names(self) -> list[str]:
        return list(self._side)

    def write_side(self, name: str, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: (T, *shape) at `slots` (T,) int64."""
        buf = self._side[name][layer]
        buf.view(-1, *buf.shape[2:]).index_copy_(0, slots, x.to(buf.dtype))

    def read_side(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """(T, *shape) at `slots` (T,) int64, after the layer's readiness wait."""
        self.wait_ready(layer)
        buf = self._side[name][layer]
        return buf.view(-1, *buf.shape[2:]).index_select(0, slots)

    # ---- page copies between caches (host tier) --------------------------------------------
    def copy_layer_from(self, src: KVCache, layer: int, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy `src`'s pages `src_ids` of `layer` (K, V and side buffers) into this cache's
        `dst_ids` (same count). Both caches must share layout and stored dtype (a host copy of
        the device cache). No readiness wait on either side: the caller owns the ordering."""
        s_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        d_idx = torch.tensor(dst_ids, dtype=torch.long, device=self.device)
        for mine, theirs in ((self._k, src._k), (self._v, src._v)):
            target, values = mine[layer], theirs[layer].index_select(1, s_idx).to(self.device)
            if self.is_fp8:
                target, values = target.view(torch.uint8), values.view(torch.uint8)
            target.index_copy_(1, d_idx, values)
        for name, bufs in self._side.items():
            bufs[layer].index_copy_(0, d_idx, src._side[name][layer].index_select(0, s_idx).to(self.device))

    def like(self, num_pages: int, device: torch.device | str) -> KVCache:
        """An empty cache with this one's layout, dtype, scales and side buffers but
        `num_pages` pages on `device` (the host tier's store)."""
        other = KVCache(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim,
                        self.dtype, device, self.compute_dtype, self.k_scale.cpu(), self.v_scale.cpu())
        for name, bufs in self._side.items():
            other.add_side_buffer(name, tuple(bufs[0].shape[2:]), bufs[0].dtype)
        return other

    # ---- page export / import (host tier, prefill->decode transfer) ---------------------------
    def export_pages(self, page_ids: list[int]) -> KVPages:
        """Copy pages out, stored dtype (FP8 stays FP8; scales are the cache's), onto the CPU."""
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            self.wait_ready(layer)

        def take(stores: list[torch.Tensor], dim: int) -> torch.Tensor:
            return torch.stack([s.index_select(dim, idx) for s in stores]).cpu()

        return KVPages(take(self._k, 1), take(self._v, 1),
                       {name: take(bufs, 0) for name, bufs in self._side.items()})

    def slot_checksums(self, slots: list[int]) -> list[int]:
        """Per slot id, the integer sum of its stored bits (viewed as signed ints of the storage
        width) over every layer's K and V; side buffers excluded. Each layer's K or V sums in
        int32: exact for 1- and 2-byte storage (heads * head_dim values of magnitude at most 2^15
        each, exact below 65,536 of them), wrapping modulo 2^32 for 4-byte storage, which a
        two's-complement add does alike in any order. So equal bytes always give equal sums
        (engine/kv_checksum.py); with an int64 accumulator the re-checks of the default model's
        4-byte KV ran 1.3x slower (docs/anomaly_guard.md).
        Does not wait for fills in flight: the slots it is given are final ones."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        bits = {4: torch.int32, 2: torch.int16, 1: torch.int8}[self._k[0].element_size()]
        total = torch.zeros(len(idx), dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            for store in (self._k[layer], self._v[layer]):
                rows = store.view(bits).view(self.num_kv_heads, -1, self.head_dim).index_select(1, idx)
                total += rows.sum(dim=(0, 2), dtype=torch.int32)
        return total.tolist()

    def import_pages(self, page_ids: list[int], data: KVPages) -> None:
        """Write exported pages into `page_ids` (same count, same layout and stored dtype).
        Raises ValueError on a shape or dtype mismatch."""
        expect = (self.num_layers, self.num_kv_heads, len(page_ids), self.page_size, self.head_dim)
        if tuple(data.k.shape) != expect or data.k.dtype != self.dtype or set(data.side) != set(self._side):
            raise ValueError(f"imported pages {tuple(data.k.shape)} {data.k.dtype} do not fit "
                             f"this cache {expect} {self.dtype}")
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            for store, src in ((self._k, data.k), (self._v, data.v)):
                target, values = store[layer], src[layer].to(self.device)
                if self.is_fp8:
                    target, values = target.view(torch.uint8), values.view(torch.uint8)
                target.index_copy_(1, idx, values)
            for name, bufs in self._side.items():
                bufs[layer].index_copy_(0, idx, data.side[name][layer].to(self.device))
