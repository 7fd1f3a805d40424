"""KV pages as bytes for prefill->decode transfer: pack what KVCache.export_pages returns, unpack into what import_pages takes, and the model identity of the handshake."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.layers.parallel import shard_heads
from radixserve.runner.kv_cache import KVCache, KVPages


@dataclass(frozen=True, slots=True)
class KVImport:
    """A PD decode worker's import, sent by rank 0 on the step group between batches (runner/tp.py; defined here, not
    in tp.py, which followers run as __main__): each follower runs ModelRunner.import_kv(page_ids, data, foreign)."""

    page_ids: list[int]
    data: bytes
    foreign: bool


@dataclass(frozen=True, slots=True)
class KVExport:
    """Rank 0 of a LayerSplit or GQA TP prefill worker asks the followers (between batches) to run export_kv."""

    page_ids: list[int]


def pack_pages(pages: KVPages) -> bytes:
    """Raw bytes of K, V, then side buffers in name order (stored dtype, C order); the receiver's cache gives the shapes."""
    parts = [pages.k, pages.v, *(pages.side[name] for name in sorted(pages.side))]
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)


def unpack_pages(kv: KVCache, num_pages: int, data: bytes, heads: tuple[int, int] | None = None) -> KVPages:
    """Inverse of pack_pages. `heads` (total, first): bytes hold `total` KV heads, `kv` keeps kv.num_kv_heads from
    `first` on (a TP rank's share; None: kv's own). ValueError: bytes not fitting `num_pages` of that layout."""
    total, first = heads or (kv.num_kv_heads, 0)
    kv_shape = (kv.num_layers, total, num_pages, kv.page_size, kv.head_dim)
    v_shape = (kv.num_layers, 0 if kv.latent else total, num_pages, kv.page_size, kv.head_dim)
    shapes = [(kv_shape, kv.dtype), (v_shape, kv.dtype)]
    shapes.extend(kv.side_export(name, num_pages) for name in sorted(kv.side_names))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tensors, offset = [], 0
    for shape, dtype in shapes:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset + n > raw.numel():
            raise ValueError(f"KV payload of {len(data)} bytes is too short for {num_pages} pages")
        tensors.append(raw[offset:offset + n].view(dtype).view(shape))
        offset += n
    if offset != raw.numel():
        raise ValueError(f"KV payload of {len(data)} bytes does not fit {num_pages} pages")
    side = dict(zip(sorted(kv.side_names), tensors[2:]))
    mine = slice(first, first + kv.num_kv_heads)
    return KVPages(tensors[0][:, mine].contiguous(), tensors[1][:, mine].contiguous(), side)


def gather_kv_heads(pages: KVPages, tp, model_config) -> KVPages | None:
    """Every TP rank's `pages` (its KV heads) -> all the model's heads at rank 0 (a copy sent once), else None."""
    assert not pages.side, "a TP export with side buffers is not built"
    ranks = [SimpleNamespace(rank=r, size=tp.size) for r in range(tp.size)]
    starts = [shard_heads(model_config.num_heads, model_config.num_kv_heads, r).kv_start for r in ranks]
    senders = [r for r, start in enumerate(starts) if starts.index(start) == r]
    if tp.rank != 0:
        for pending in [tp.send_async(t.to(tp.device), 0) for t in (pages.k, pages.v)] if tp.rank in senders else []:
            pending.wait()
        return None
    k, v = [pages.k], [pages.v]
    for rank in senders[1:]:
        k.append(tp.recv(torch.empty_like(pages.k, device=tp.device), rank).cpu())
        v.append(tp.recv(torch.empty_like(pages.v, device=tp.device), rank).cpu())
    return KVPages(torch.cat(k, dim=1), torch.cat(v, dim=1), {})


def first_kv_head(model_config, tp) -> int:
    """First model KV head a rank of TP group `tp` (None: no TP) caches; 0 for MLA (latent head on every rank)."""
    if model_config.kv_shape.latent:
        return 0
    return shard_heads(model_config.num_heads, model_config.num_kv_heads, tp).kv_start


def model_identity(model_config, model: torch.nn.Module) -> str:
    """Architecture, sizes and a CRC of the first parameter's first 256 values (a cheap check, not a proof)."""
    fingerprint = "none"
    first = next(iter(model.parameters()), None)
    if first is not None:
        head = first.detach().flatten()[:256].float().cpu().contiguous()
        fingerprint = f"{zlib.crc32(head.numpy().tobytes()):08x}"
    mc = model_config
    return (f"{mc.architecture} layers={mc.num_layers} hidden={getattr(mc, 'hidden_size', '?')} "
            f"vocab={mc.vocab_size} weights={fingerprint}")
