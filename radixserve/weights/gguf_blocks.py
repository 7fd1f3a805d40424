"""Decode GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) into 4-bit codes with per-32-column scale and zero, without fp32 weights.

Every supported type dequantizes, per group of 32 consecutive columns of a row, to
`w = (q - 8) * scale + zero` with q in 0..15, the form torch's int4 kernel computes
(layers/quant_linear.py). From ggml's reference dequantizers (ggml-quants.c,
`dequantize_row_q4_0/_q4_1/_q4_K`; the `gguf` package's numpy copies agree):

    Q4_0  block of 32:  fp16 d, 16 bytes of codes      w = d * (q - 8)
    Q4_1  block of 32:  fp16 d, fp16 m, 16 bytes       w = d * q + m
    Q4_K  block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, mn) for 8 sub-blocks of 32,
                        128 bytes of codes            w = d*sc * q - dmin*mn

so scale = d (Q4_0, Q4_1) or d*sc (Q4_K), and zero = 0, m + 8d, or 8*d*sc - dmin*mn. Codes
within a block: Q4_0/Q4_1 byte j holds element j (low nibble) and j + 16 (high nibble);
Q4_K's four 32-byte runs each hold 64 elements, the first 32 in the low nibbles.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

GROUP_SIZE = 32   # columns sharing one (scale, zero) in every type below
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


class Int4Blocks(NamedTuple):
    """A weight (N rows, K columns) as 4-bit codes: codes (N, K) uint8 in 0..15; scale and
    zero (N, K / 32) float32; weight[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., B) packed bytes -> (..., 2B) codes: the B low nibbles, then the B high ones."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 holding little-endian fp16 -> (...) float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_int4(type_name: str, data: np.ndarray, num_cols: int) -> Int4Blocks:
    """GGUF tensor bytes of a Q4_0, Q4_1 or Q4_K weight -> Int4Blocks.

    data: (N, bytes per row) uint8 as `gguf.GGUFReader` exposes it; num_cols: K (a multiple
    of 32, of 256 for Q4_K). Raises ValueError for another type or a row size that does not fit.
    """
    data = np.asarray(data, dtype=np.uint8)
    rows = data.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = _reshape(data, rows, num_cols // 32, head + 16, type_name)
        d = _f16(blocks[..., 0:2])                                   # (N, K/32)
        codes = _nibbles(blocks[..., head:])                          # (N, K/32, 32)
        zero = np.zeros_like(d) if type_name == "Q4_0" else _f16(blocks[..., 2:4]) + 8 * d
        return Int4Blocks(codes.reshape(rows, num_cols), d, zero)
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = _reshape(data, rows, num_cols // 256, 144, type_name)
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))   # (N * K/256, 8) each
        sc = sc.reshape(rows, -1, 8).astype(np.float32)
        mn = mn.reshape(rows, -1, 8).astype(np.float32)
        scale = d * sc                                                # (N, K/256, 8)
        zero = 8 * scale - dmin * mn
        codes = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))   # (N, K/256, 4, 64)
        return Int4Blocks(codes.reshape(rows, num_cols), scale.reshape(rows, -1), zero.reshape(rows, -1))
    raise ValueError(f"no int4 mapping for GGUF type {type_name}")


def _reshape(data: np.ndarray, rows: int, num_blocks: int, block_bytes: int, type_name: str) -> np.ndarray:
    if data.shape[1] != num_blocks * block_bytes:
        raise ValueError(f"{type_name}: {data.shape[1]} bytes per row, expected {num_blocks} blocks "
                         f"of {block_bytes}")
    return data.reshape(rows, num_blocks, block_bytes)
