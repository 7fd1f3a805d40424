"""Weight-only quantized matmul on the CPU: int4 (GGUF Q4_0 / Q4_1 / Q4_K, exact) and per-row int8, on torch's own kernels.

`_weight_int4pack_mm_for_cpu` computes y = x @ W.T with W[n, k] = (q[n, k] - 8) * scale[k // g, n]
+ zero[k // g, n] (q in 0..15, groups of g = 32 columns; layout and sign checked against that
formula on torch 2.13); GGUF's 4-bit types map onto it exactly (weights/gguf_blocks.py).
`_weight_int8pack_mm` takes one scale per output row only, so GGUF's per-32 block scales
(Q8_0, Q6_K, ...) cannot map exactly: int8 requantizes a weight per row (`Int8Weight`).

Why bf16 activations: on this AVX2 CPU both kernels have a vectorised path for bf16 only; with
fp32 or fp16 activations they are 5-50x slower than the fp32 GEMM (docs/benchmarks.md,
"Quantized linear layers"). The kernels demand scales in the activation dtype, so scale and
zero are rounded to bf16 too, and the output comes back in bf16.

Error (against GGUF's fp32 dequantization w, per output): x, the dequantized weight and the
output are each rounded to bf16 (unit roundoff 2^-9), products accumulate in fp32, so
|y - x @ w.T| <= ~3 * 2^-9 * (|x| @ |w|.T) (tests/unit/test_quant_linear.py checks 2x that).
For int4 that is ~30x below the 4-bit step itself (|scale| / 2 on a range of ~15 |scale|).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
ACTIVATION_DTYPE = torch.bfloat16
_PACK_ROWS = 16   # the packing op wants N divisible by 16


@dataclass(frozen=True)
class Int4Weight:
    """One checkpoint weight (N, K) as int4 codes: codes (N, K) uint8 in 0..15; scale, zero
    (N, K / 32) float32; weight = (codes - 8) * scale + zero per group of 32 columns.
    `dequantize()` gives the float32 weight the kernel approximates (see module docstring)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def take_rows(self, index: torch.Tensor) -> Int4Weight:
        """Rows reordered by `index` (N,) int64 (llama.cpp's q/k permutation, GLM's RoPE rows)."""
        return Int4Weight(*(t.index_select(0, index) for t in (self.codes, self.scale, self.zero)))

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: GGUF's dequantization of the source blocks (up to fp32 rounding)."""
        def expand(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.codes.float() - 8) * expand(self.scale) + expand(self.zero)


class Int4Matmul:
    """y = x @ W.T for W the row-wise concatenation of `weights` (fused layers: q|k|v,
    gate|up), packed once for `_weight_int4pack_mm_for_cpu`.

    x: (M, K) float32 or bfloat16 -> (M, N) in x's dtype (`cast_back=False`: in bf16, the
    kernel's output, saving a cast where the next op takes bf16). Memory: N*K/2 bytes of codes plus
    4 bytes per group of 32 (bf16 scale and zero). Raises ValueError when the rows do not
    share K or N is not a multiple of 16 (the packing op's requirement).
    """

    def __init__(self, weights: list[Int4Weight]):
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError("int4 shards of one layer must share their number of columns")
        codes = torch.cat([w.codes for w in weights])                          # (N, K)
        if codes.shape[0] % _PACK_ROWS:
            raise ValueError(f"int4 packing needs rows divisible by {_PACK_ROWS}, got {codes.shape[0]}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scale = torch.cat([w.scale for w in weights])                           # (N, K/g)
        zero = torch.cat([w.zero for w in weights])
        # (K/g, N, 2) in the activation dtype, the kernel's layout.
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()

    def __call__(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACTIVATION_DTYPE), self.packed,
                                                       GROUP_SIZE, self.scales_zeros)
        return y.to(x.dtype) if cast_back else y


@dataclass(frozen=True)
class Int8Weight:
    """One checkpoint weight (N, K) as int8 with one scale per output row: values (N, K) int8,
    scale (N,) float32; weight = values * scale[:, None]. `from_float` quantizes symmetrically
    by the row's absolute maximum (the only scale layout `_weight_int8pack_mm` takes)."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """weight (N, K) float -> Int8Weight; per element error <= scale / 2 = max|row| / 254."""
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        return cls(torch.round(weight / scale[:, None]).to(torch.int8), scale.float())

    def take_rows(self, index: torch.Tensor) -> Int8Weight:
        """Rows reordered by `index` (N,) int64."""
        return Int8Weight(self.values.index_select(0, index), self.scale.index_select(0, index))

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        return self.values.float() * self.scale[:, None]


class Int8Matmul:
    """y = x @ W.T on `_weight_int8pack_mm` for W the row-wise concatenation of `weights`.
    x: (M, K) float32 or bfloat16 -> (M, N) in x's dtype, or bf16 with `cast_back=False`
    (computed with bf16 activations and scales, like Int4Matmul). Memory: N*K bytes plus 2
    bytes a row."""

    def __init__(self, weights: list[Int8Weight]):
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError("int8 shards of one layer must share their number of columns")
        self.values = torch.cat([w.values for w in weights]).contiguous()      # (N, K) int8
        self.scale = torch.cat([w.scale for w in weights]).to(ACTIVATION_DTYPE)

    def __call__(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), self.values, self.scale)
        return y.to(x.dtype) if cast_back else y


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX, as torch reports it) and
    oneDNN packs and runs a bf16 weight here. There oneDNN's bf16 GEMM takes 0.52-0.62x the time
    of its fp32 GEMM on the default model's layer shapes at 256-1,024 rows, casts included
    (AVX-512 EPYC, 2 threads, docs/benchmarks.md); without native bf16 it emulates and loses.
    Checked once per process, the choice logged once."""
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


QuantWeight = Int4Weight | Int8Weight
MATMULS = {Int4Weight: Int4Matmul, Int8Weight: Int8Matmul}


def _probe_weight(kind: type, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    if kind is Int4Weight:
        return Int4Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          torch.rand(n, k // GROUP_SIZE, generator=gen) + 0.5,
                          torch.randn(n, k // GROUP_SIZE, generator=gen))
    return Int8Weight(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                      torch.rand(n, generator=gen) + 0.5)


@functools.cache
def kernel_available(kind: type) -> bool:
    """Whether the kernel of `kind` (Int4Weight or Int8Weight) runs on this CPU and reproduces
    its weight's `dequantize()` on a small random weight, within bf16 rounding of the weight
    and the output (~2^-8 of the output's scale). Checked once per process per kind; a
    missing or wrong kernel is logged once and its layers use fp32."""
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
