"""Decode GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) into 4-bit codes with per-32-column scale and zero, without fp32 weights.

Per 32 columns w = (q - 8) * scale + zero, q in 0..15 (ggml-quants.c, dequantize_row_q4_0/_q4_1/_q4_K), with (scale,
zero): Q4_0 w = d(q - 8): (d, 0); Q4_1 w = dq + m: (d, m + 8d); Q4_K w = d*sc*q - dmin*mn: (d*sc, 8*d*sc - dmin*mn).
Q4_0 / Q4_1 byte j holds element j (low nibble) and j + 16; Q4_K's 32-byte runs hold 64 elements, low nibbles first."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

GROUP_SIZE = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


class Int4Blocks(NamedTuple):
    """codes (N, K) uint8 in 0..15; scale, zero (N, K / 32) fp32."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., B) packed bytes -> (..., 2B) codes: the B low nibbles, then the B high ones."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_int4(type_name: str, data: np.ndarray, num_cols: int) -> Int4Blocks:
    """data (N, row bytes) uint8 (GGUFReader's) -> Int4Blocks; ValueError: another type, rows not fitting `num_cols`."""
    data = np.asarray(data, dtype=np.uint8)
    rows = data.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = _reshape(data, rows, num_cols // 32, head + 16, type_name)
        d = _f16(blocks[..., 0:2])
        codes = _nibbles(blocks[..., head:])
        zero = np.zeros_like(d) if type_name == "Q4_0" else _f16(blocks[..., 2:4]) + 8 * d
        return Int4Blocks(codes.reshape(rows, num_cols), d, zero)
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = _reshape(data, rows, num_cols // 256, 144, type_name)
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(rows, -1, 8).astype(np.float32)
        mn = mn.reshape(rows, -1, 8).astype(np.float32)
        scale = d * sc
        zero = 8 * scale - dmin * mn
        codes = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))
        return Int4Blocks(codes.reshape(rows, num_cols), scale.reshape(rows, -1), zero.reshape(rows, -1))
    raise ValueError(f"no int4 mapping for GGUF type {type_name}")


def _reshape(data: np.ndarray, rows: int, num_blocks: int, block_bytes: int, type_name: str) -> np.ndarray:
    if data.shape[1] != num_blocks * block_bytes:
        raise ValueError(f"{type_name}: {data.shape[1]} bytes per row, expected {num_blocks} blocks "
                         f"of {block_bytes}")
    return data.reshape(rows, num_blocks, block_bytes)
