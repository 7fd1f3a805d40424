"""Weight-only quantized matmul on the CPU: int4 (GGUF Q4_0 / Q4_1 / Q4_K, exact) and per-row int8, on torch's own kernels.

int4: W[n, k] = (q - 8) * scale[k // 32, n] + zero[k // 32, n], q in 0..15; int8: one scale per output row. Activations,
scales and output are bf16: |y - x @ w.T| <= ~3 * 2^-9 * (|x| @ |w|.T) against fp32 dequantization (docs/runner.md)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from radixserve.layers.int4_fp32 import Int4F32Matmul
from radixserve.layers.int4_int8 import Int4Int8Matmul

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
ACTIVATION_DTYPE = torch.bfloat16
_PACK_ROWS = 16


@dataclass(frozen=True)
class Int4Weight:
    """codes (N, K) uint8 in 0..15; scale, zero (N, K / 32) fp32; weight = (codes - 8) * scale + zero per 32 columns."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def take_rows(self, index: torch.Tensor) -> Int4Weight:
        return type(self)(*(t.index_select(0, index) for t in (self.codes, self.scale, self.zero)))

    def dequantize(self) -> torch.Tensor:
        def expand(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.codes.float() - 8) * expand(self.scale) + expand(self.zero)


class Int4Matmul:
    """x (M, K) @ W.T -> (M, N), W the shards' rows stacked; ValueError unless they share K and N % 16 == 0."""

    def __init__(self, weights: list[Int4Weight]):
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError("int4 shards of one layer must share their number of columns")
        codes = torch.cat([w.codes for w in weights])
        if codes.shape[0] % _PACK_ROWS:
            raise ValueError(f"int4 packing needs rows divisible by {_PACK_ROWS}, got {codes.shape[0]}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scale = torch.cat([w.scale for w in weights])
        zero = torch.cat([w.zero for w in weights])
        # the kernel's layout: (K / 32, N, 2) in the activation dtype
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()

    def __call__(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACTIVATION_DTYPE), self.packed,
                                                       GROUP_SIZE, self.scales_zeros)
        return y.to(x.dtype) if cast_back else y


@dataclass(frozen=True)
class Int8Weight:
    """values (N, K) int8, scale (N,) fp32; weight = values * scale[:, None]."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row absmax quantization; per element error <= max|row| / 254."""
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        return cls(torch.round(weight / scale[:, None]).to(torch.int8), scale.float())

    def take_rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.values.index_select(0, index), self.scale.index_select(0, index))

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale[:, None]


class Int8Matmul:
    """As Int4Matmul, on `_weight_int8pack_mm`."""

    def __init__(self, weights: list[Int8Weight]):
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError("int8 shards of one layer must share their number of columns")
        self.values = torch.cat([w.values for w in weights]).contiguous()
        self.scale = torch.cat([w.scale for w in weights]).to(ACTIVATION_DTYPE)

    def __call__(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), self.values, self.scale)
        return y.to(x.dtype) if cast_back else y


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX) and oneDNN's bf16 GEMM agrees with fp32 here."""
    cpu = getattr(torch, "cpu", None)
    flags = [getattr(cpu, name, lambda: False)() for name in
             ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not any(flags) or not torch.backends.mkldnn.is_available():
        logger.info("no native bf16 on this CPU: quantized layers keep fp32 copies")
        return False
    try:
        w = torch.randn(32, 64)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 32)
        x = torch.randn(4, 64)
        got = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        logger.info("bf16 GEMM unavailable (%s): quantized layers keep fp32 copies", exc)
        return False
    ref = x @ w.t()
    if float((got.float() - ref).abs().max()) > 2e-2 * float(ref.abs().max()):
        logger.warning("bf16 GEMM disagrees with fp32 here: quantized layers keep fp32 copies")
        return False
    logger.info("native bf16 on this CPU: quantized layers keep bf16 copies for large steps")
    return True


class Int4Int8Weight(Int4Weight):
    """An Int4Weight served by int4_int8.py (int8 activations; batch-invariant, fp32 out) instead of torch's kernel."""


class Int4F32Weight(Int4Weight):
    """An Int4Weight served by int4_fp32.py (fp32 activations; batch-invariant, fp32 out) instead of torch's kernel."""


QuantWeight = Int4Weight | Int8Weight
MATMULS = {Int4Weight: Int4Matmul, Int8Weight: Int8Matmul, Int4Int8Weight: Int4Int8Matmul,
           Int4F32Weight: Int4F32Matmul}


def _probe_weight(kind: type, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    if issubclass(kind, Int4Weight):
        return kind(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          torch.rand(n, k // GROUP_SIZE, generator=gen) + 0.5,
                          torch.randn(n, k // GROUP_SIZE, generator=gen))
    return Int8Weight(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                      torch.rand(n, generator=gen) + 0.5)


@functools.cache
def kernel_available(kind: type) -> bool:
    """Whether the kernel of `kind` runs here and reproduces `dequantize()` within bf16 rounding (logged once if not)."""
    gen = torch.Generator().manual_seed(0)
    weight = _probe_weight(kind, 32, 2 * GROUP_SIZE, gen)
    x = torch.randn(3, 2 * GROUP_SIZE, generator=gen)
    name = kind.__name__.removesuffix("Weight").lower()
    try:
        got = MATMULS[kind]([weight])(x)
    except (RuntimeError, AttributeError) as exc:
        logger.warning("%s weight kernel unavailable on this CPU (%s); those layers use fp32", name, exc)
        return False
    ref = x.to(ACTIVATION_DTYPE).float() @ weight.dequantize().t()
    if float((got - ref).abs().max()) > 1e-2 * float(ref.abs().max()):
        logger.warning("%s weight kernel disagrees with its reference here (max |diff| %.3g); "
                       "those layers use fp32", name, float((got - ref).abs().max()))
        return False
    return True
