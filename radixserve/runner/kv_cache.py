"""KVCache: the one owner of paged K/V storage (layout, dtype incl. FP8 with scales, device) and every read and write of it.

Per layer K, V: (num_kv_heads, num_pages, page_size, head_dim), slot = page_id * page_size + offset; the latent layout
(MLA, docs/mla.md) stores K only and V reads return K. FP8 stores clamped x / scale per (layer, KV head), reads return
stored * scale; reads wait while a begin_fill lacks its end_fill (docs/runner.md)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from radixserve.runner.device import zeros

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class KVPages:
    """Stored dtype on the CPU: k, v (layers, KV, n, page_size, head_dim), v with 0 heads in the latent layout;
    side: name -> (its layers, n, page_size, *shape), its layers being those add_side_buffer gave it, in order."""

    k: torch.Tensor
    v: torch.Tensor
    side: dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelView:
    """One layer's storage, read-only: k, v (KV, num_pages, page_size, D) stored dtype; k_scale, v_scale (KV,) fp32."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


class KVCache:
    """Zero-initialised; `dtype` stored, `compute_dtype` (default `dtype`) read; k_scale, v_scale (layers, KV) fp32 for FP8
    (`latent`: V reads use k_scale)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, latent: bool = False):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device, self.latent = dtype, torch.device(device), latent
        self.compute_dtype = compute_dtype or dtype
        self.is_fp8 = dtype in FP8_DTYPES.values()
        if self.is_fp8 and (k_scale is None or v_scale is None):
            raise ValueError("float8 KV storage needs k_scale and v_scale")
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        # Anonymous mappings on CPU (device.zeros): a page of the pool costs memory once a slot in it is written.
        self._k = [zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self._v = self._k if latent else [zeros(shape, dtype, self.device)
                                          for _ in range(num_layers)]
        self._stores = [self._k] if latent else [self._k, self._v]
        self._head_offsets = torch.arange(num_kv_heads, device=self.device) * num_pages
        self._fp8_max = torch.finfo(dtype).max if self.is_fp8 else 0.0
        ones = torch.ones(num_layers, num_kv_heads)
        self.k_scale = (k_scale if k_scale is not None else ones).float().to(self.device)
        self.v_scale = (self.k_scale if latent
                        else (v_scale if v_scale is not None else ones).float().to(self.device))
        self._side: dict[str, list[torch.Tensor]] = {}
        self._side_layers: dict[str, dict[int, int]] = {}     # name -> {layer: index into _side[name]}
        self._ready = [threading.Event() for _ in range(num_layers)]
        for event in self._ready:
            event.set()
        self._filling = [0] * num_layers
        self._fill_lock = threading.Lock()
        self.skip_readiness_wait = False        # test/fault only: reads ignore fills in flight
        self.skip_side_readiness_wait = False   # fault only: side-buffer reads (DSA index keys) do (GLM-5's race)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        latent: bool = False) -> int:
        stores = 1 if latent else 2
        return stores * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Stored bytes per token over all layers, side buffers excluded."""
        return self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.latent)

    @property
    def slot_bytes(self) -> int:
        """Stored bytes per token slot: token_bytes plus every side buffer's bytes in the layers that have it."""
        side = sum(b.numel() * b.element_size() for bufs in self._side.values() for b in bufs)
        return self.token_bytes + side // (self.num_pages * self.page_size)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache holds for its pages: K, V (once in the latent layout) and side buffers."""
        tensors = [t for stores in (*self._stores, *self._side.values()) for t in stores]
        return sum(t.numel() * t.element_size() for t in tensors)

    def begin_fill(self, layers: range | list[int]) -> None:
        """Reads of `layers` block until each fill begun ends; call before the filler starts, on the reads' thread."""
        with self._fill_lock:
            for layer in layers:
                self._filling[layer] += 1
                self._ready[layer].clear()

    def end_fill(self, layer: int) -> None:
        with self._fill_lock:
            assert self._filling[layer] > 0, f"end_fill({layer}) without begin_fill"
            self._filling[layer] -= 1
            if self._filling[layer] == 0:
                self._ready[layer].set()

    def wait_ready(self, layer: int, side: bool = False) -> None:
        event = self._ready[layer]
        if not event.is_set() and not self.skip_readiness_wait and not (side and self.skip_side_readiness_wait):
            event.wait()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: (T, KV, D) compute dtype at `slots`: (T,) int64, quantising for FP8; latent: v is not read."""
        flat = (self.num_kv_heads, self.num_pages * self.page_size, self.head_dim)
        for store, x, scale in zip(self._stores, (k, v), (self.k_scale, self.v_scale)):
            data = self._encode(x.transpose(0, 1), scale[layer])
            target = store[layer].view(flat)
            if self.is_fp8:  # CPU index_copy_ has no float8 kernel: copy the bytes
                target, data = target.view(torch.uint8), data.view(torch.uint8)
            target.index_copy_(1, slots, data)

    def _encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not self.is_fp8:
            return x.to(self.dtype)
        q = x.float() / scale[:, None, None]
        return q.clamp_(-self._fp8_max, self._fp8_max).to(self.dtype)

    def _decode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not self.is_fp8:
            return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        view = scale.view(-1, *([1] * (x.dim() - 1)))
        return (x.float() * view).to(self.compute_dtype)

    round_trip_by_slot = False     # round_trip's result depends on `slots` (MixedKVCache)

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (T, KV, D) as a later read returns them (lossy for FP8), for DecodeMirror; `slots` unused here."""
        if not self.is_fp8 and self.dtype == self.compute_dtype:
            return k, v
        out = []
        for _, x, scale in zip(self._stores, (k, v), (self.k_scale[layer], self.v_scale[layer])):
            stored = self._encode(x.transpose(0, 1), scale)
            out.append(self._decode(stored, scale).transpose(0, 1))
        return out[0], out[-1]

    def head_rows(self, page_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 page ids -> (KV * n,) int64 head-major rows of the (KV * num_pages, page_size * D) view."""
        return (self._head_offsets[:, None] + page_ids[None, :]).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from head_rows (KV * n,) -> K, V (KV * n, page_size * D) compute dtype, into k_out/v_out if given
        (latent: V is the returned K and v_out is not written)."""
        self.wait_ready(layer)
        flat = (self.num_kv_heads * self.num_pages, self.page_size * self.head_dim)
        out = []
        for store, scale, buf in zip(self._stores, (self.k_scale, self.v_scale), (k_out, v_out)):
            if not self.is_fp8 and self.dtype == self.compute_dtype:
                out.append(torch.index_select(store[layer].view(flat), 0, rows, out=buf))
                continue
            raw = torch.index_select(store[layer].view(flat), 0, rows)
            deq = self._decode(raw.view(self.num_kv_heads, -1), scale[layer]).view(raw.shape)
            out.append(buf.copy_(deq) if buf is not None else deq)
        return out[0], out[-1]

    def read_pages(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `page_ids` (n,) int64 as (KV, n * page_size, D) in compute dtype."""
        k, v = self.gather(layer, self.head_rows(page_ids))
        shape = (self.num_kv_heads, -1, self.head_dim)
        return k.view(shape), v.view(shape)

    def plain_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plain storage only (not FP8, not latent): the layer's K, V (KV, num_pages, page_size, D) and the same storage
        as (KV, num_pages * page_size, D), for a per-step caller that writes them as `write` does (index_copy_ on dim 1
        at slots of values cast to the stored dtype) and reads them as kernel_view does (after wait_ready)."""
        assert not self.is_fp8 and not self.latent, "plain_views: FP8 or latent storage goes through write"
        flat = (self.num_kv_heads, self.num_pages * self.page_size, self.head_dim)
        return self._k[layer], self._v[layer], self._k[layer].view(flat), self._v[layer].view(flat)

    def kernel_view(self, layer: int) -> KernelView:
        self.wait_ready(layer)
        return KernelView(self._k[layer], self._v[layer], self.k_scale[layer], self.v_scale[layer])

    def add_side_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                        layers: list[int] | None = None) -> None:
        """Allocate storage of `shape` per slot, zeroed, (num_pages, page_size, *shape) in each of `layers` (None: all);
        the tiers, PD and page copies carry it with K and V, layer by layer."""
        assert name not in self._side, f"side buffer {name!r} exists"
        layers = list(range(self.num_layers)) if layers is None else sorted(layers)
        full = (self.num_pages, self.page_size, *shape)
        self._side[name] = [zeros(full, dtype, self.device) for _ in layers]
        self._side_layers[name] = {layer: i for i, layer in enumerate(layers)}

    @property
    def side_names(self) -> list[str]:
        return list(self._side)

    def side_layers(self, name: str) -> list[int]:
        return list(self._side_layers[name])

    def _side_buf(self, name: str, layer: int) -> torch.Tensor:
        index = self._side_layers[name].get(layer)
        assert index is not None, f"side buffer {name!r} has no layer {layer}"
        return self._side[name][index]

    def write_side(self, name: str, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store x (T, *shape) at `slots` (T,) int64."""
        buf = self._side_buf(name, layer)
        buf.view(-1, *buf.shape[2:]).index_copy_(0, slots, x.to(buf.dtype))

    def read_side(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """(T, *shape) stored dtype at `slots` (T,) int64, after the layer's readiness wait."""
        self.wait_ready(layer, side=True)
        buf = self._side_buf(name, layer)
        return buf.view(-1, *buf.shape[2:]).index_select(0, slots)

    def read_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K at `slots` (T,) int64 as (T, KV, D) compute dtype, after the layer's readiness wait (sparse attention)."""
        self.wait_ready(layer)
        flat = self._k[layer].view(self.num_kv_heads, self.num_pages * self.page_size, self.head_dim)
        raw = flat.view(torch.uint8).index_select(1, slots).view(self.dtype) if self.is_fp8 else \
            flat.index_select(1, slots)
        return self._decode(raw, self.k_scale[layer]).transpose(0, 1)

    def v_shape(self, num_pages: int) -> tuple[int, ...]:
        """Exported V's shape: no heads in the latent layout."""
        heads = 0 if self.latent else self.num_kv_heads
        return (self.num_layers, heads, num_pages, self.page_size, self.head_dim)

    def side_export(self, name: str, num_pages: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Exported side buffer `name`'s shape (its layers, num_pages, page_size, *shape) and dtype."""
        bufs = self._side[name]
        return (len(bufs), num_pages, *bufs[0].shape[1:]), bufs[0].dtype

    def copy_layer_from(self, src: KVCache, layer: int, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy `src`'s pages src_ids of `layer` into dst_ids (same layout, dtype); no readiness wait: the caller orders it."""
        s_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        d_idx = torch.tensor(dst_ids, dtype=torch.long, device=self.device)
        for mine, theirs in zip(self._stores, src._stores):
            target, values = mine[layer], theirs[layer].index_select(1, s_idx).to(self.device)
            if self.is_fp8:
                target, values = target.view(torch.uint8), values.view(torch.uint8)
            target.index_copy_(1, d_idx, values)
        for name, where in self._side_layers.items():
            if layer in where:
                values = src._side_buf(name, layer).index_select(0, s_idx).to(self.device)
                self._side[name][where[layer]].index_copy_(0, d_idx, values)

    def like(self, num_pages: int, device: torch.device | str) -> KVCache:
        other = KVCache(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim,
                        self.dtype, device, self.compute_dtype, self.k_scale.cpu(), self.v_scale.cpu(), self.latent)
        for name, bufs in self._side.items():
            other.add_side_buffer(name, tuple(bufs[0].shape[2:]), bufs[0].dtype, self.side_layers(name))
        return other

    def export_pages(self, page_ids: list[int]) -> KVPages:
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            self.wait_ready(layer)

        def take(stores: list[torch.Tensor], dim: int) -> torch.Tensor:
            return torch.stack([s.index_select(dim, idx) for s in stores]).cpu()

        k = take(self._k, 1)
        return KVPages(k, k[:, :0] if self.latent else take(self._v, 1),
                       {name: take(bufs, 0) for name, bufs in self._side.items()})

    def slot_checksums(self, slots: list[int], num_layers: int | None = None) -> list[int]:
        """Per slot, its K and V bits summed as signed ints over layers [0, num_layers) (all by default), in int32 per
        layer (mod 2^32 for 4-byte storage), so equal bytes give equal sums in any order (engine/kv_checksum.py). No
        readiness wait."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        bits = {4: torch.int32, 2: torch.int16, 1: torch.int8}[self._k[0].element_size()]
        total = torch.zeros(len(idx), dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers if num_layers is None else num_layers):
            for store in (stores[layer] for stores in self._stores):
                rows = store.view(bits).view(self.num_kv_heads, -1, self.head_dim).index_select(1, idx)
                total += rows.sum(dim=(0, 2), dtype=torch.int32)
        return total.tolist()

    def import_pages(self, page_ids: list[int], data: KVPages) -> None:
        """Write exported pages into `page_ids`. Raises ValueError on a shape or dtype mismatch."""
        expect = (self.num_layers, self.num_kv_heads, len(page_ids), self.page_size, self.head_dim)
        sides_fit = set(data.side) == set(self._side) and all(
            (tuple(data.side[name].shape), data.side[name].dtype) == self.side_export(name, len(page_ids))
            for name in self._side)
        if (tuple(data.k.shape) != expect or data.k.dtype != self.dtype or not sides_fit
                or tuple(data.v.shape) != self.v_shape(len(page_ids))):
            raise ValueError(f"imported pages {tuple(data.k.shape)} {data.k.dtype} do not fit "
                             f"this cache {expect} {self.dtype}")
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            for store, src in zip(self._stores, (data.k, data.v)):
                target, values = store[layer], src[layer].to(self.device)
                if self.is_fp8:
                    target, values = target.view(torch.uint8), values.view(torch.uint8)
                target.index_copy_(1, idx, values)
        for name, bufs in self._side.items():
            for i, buf in enumerate(bufs):
                buf.index_copy_(0, idx, data.side[name][i].to(self.device))
