"""KV pages as bytes for prefill->decode transfer: pack what KVCache.export_pages returns, unpack into what import_pages takes, and the model identity of the handshake."""
from __future__ import annotations

import zlib

import torch

from radixserve.runner.kv_cache import KVCache, KVPages


def pack_pages(pages: KVPages) -> bytes:
    """Raw bytes of K, V, then side buffers in name order (stored dtype, C order); the receiver's cache gives the shapes."""
    parts = [pages.k, pages.v, *(pages.side[name] for name in sorted(pages.side))]
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)


def unpack_pages(kv: KVCache, num_pages: int, data: bytes) -> KVPages:
    """Inverse of pack_pages. Raises ValueError when the byte count does not fit `num_pages` of `kv`'s layout."""
    kv_shape = (kv.num_layers, kv.num_kv_heads, num_pages, kv.page_size, kv.head_dim)
    shapes = [(kv_shape, kv.dtype), (kv.v_shape(num_pages), kv.dtype)]
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
    return KVPages(tensors[0], tensors[1], side)


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
