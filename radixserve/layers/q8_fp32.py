"""GGUF Q8_0 weights x fp32 activations on the CPU: radixserve/csrc/q8_fp32.cpp, or reference_mm, its bit-identical
torch form. w = d * q per 32 columns, q int8 in -127..127 (ggml's Q8_0); per output and block b,
dot_b = block_sum(q * x), acc = acc + d * dot_b over the blocks in order, summed and rounded as int4_fp32.py: every ISA
path and the reference agree bit for bit, a row reads only itself (batch-invariant). docs/runner.md, "q8_fp32"."""
from __future__ import annotations

import functools

import torch

from radixserve.csrc import ops as csrc_ops
from radixserve.layers import int4_fp32
from radixserve.layers.int4_int8 import BLOCK

ISAS = ("scalar", "avx2", "avx512")
VECTOR_ISAS = ISAS[1:]   # the paths the LM head takes (the scalar one is slower than the fp32 head)
ISA_ENV = "RADIXSERVE_Q8_FP32_ISA"
COLS = 16   # columns a group (q8_fp32.cpp's lanes)
_CHECK_ROWS = 1024   # rows per pass: small temporaries, reused (a fresh process pays page faults per new buffer)


def supported_isas() -> tuple[str, ...]:
    """The kernel's paths this CPU runs ("scalar" first); () without the built library."""
    return csrc_ops.supported_isas("q8_fp32_mm", ISAS)


@functools.cache
def chosen_isa() -> str | None:
    """$RADIXSERVE_Q8_FP32_ISA if this CPU runs it, else the widest path; None: the torch reference (logged once)."""
    return csrc_ops.choose_isa("q8-fp32", "q8_fp32_mm", ISAS, ISA_ENV)


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight (N, K) fp32 -> (codes (N, K) int8, d (N, K / 32) fp32) with d * q == weight exactly, or None where the
    weight is not such a grid. d = max |w| / 127 per block, as ggml's Q8_0 quantizer puts a +-127 in every nonzero
    block, so a GGUF Q8_0 tensor dequantized to fp32 (gguf-py, exact) gives back its codes and fp16 scales."""
    n, k = weight.shape
    if k % BLOCK or weight.dtype != torch.float32:
        return None
    codes = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // BLOCK)
    for r0 in range(0, n, _CHECK_ROWS):
        w = weight[r0:r0 + _CHECK_ROWS].reshape(-1, k // BLOCK, BLOCK)
        db = w.abs().amax(-1) / 127
        # an all-zero block gives 0 / 0: code 0; round(q) * d == w exactly holds only where q was an integer already
        q = (w / db[..., None]).nan_to_num_(nan=0.0).round_()
        if not (torch.isfinite(db).all() and torch.equal(q * db[..., None], w)):
            return None
        codes[r0:r0 + _CHECK_ROWS] = q.reshape(-1, k).to(torch.int8)
        d[r0:r0 + _CHECK_ROWS] = db
    return codes, d


def pack(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) int8, d (N, K / 32) fp32 -> q8_fp32.cpp's codes (G, K / 32, 32, 16) int8 and scales
    (G, K / 32, 16), fp16 where every d is exact in fp16 (GGUF's own scales are), else fp32; N padded to 16G."""
    n, k = codes.shape
    pad = -n % COLS
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
    packed = codes.reshape(-1, COLS, k // BLOCK, BLOCK).permute(0, 2, 3, 1).contiguous()
    scales = d.reshape(-1, COLS, k // BLOCK).transpose(1, 2)
    half = scales.half()
    return packed, (half if torch.equal(half.float(), scales) else scales).contiguous()


def reference_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32, codes (N, K) int8, d (N, K / 32) fp32 -> (M, N) fp32, bit for bit the kernel's result."""
    return int4_fp32.reference_mm(x, codes, d, None)


class Q8F32Matmul:
    """x (M, K) @ (d * q).T -> (M, N) fp32 on `isa` (None: reference_mm); ValueError on an ISA this CPU lacks."""

    BATCH_INVARIANT = True

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, isa: str | None = "auto"):
        self.n = codes.shape[0]
        self.isa = chosen_isa() if isa == "auto" else isa
        if self.isa is not None and self.isa not in supported_isas():
            raise ValueError(f"q8-fp32 path {self.isa!r} not available here (have {supported_isas()})")
        if self.isa is None:
            self.codes, self.d = codes, d
        else:
            self.packed, self.scales = pack(codes, d)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.isa is None:
            return reference_mm(x.float(), self.codes, self.d)
        return torch.ops.radixserve.q8_fp32_mm(x.float(), self.packed, self.scales, self.n, ISAS.index(self.isa))


class Q8Head:
    """An LM head whose fp32 weight is a Q8_0 grid (q8_0_blocks), for small steps: `__call__(x, weight, bias)` x (M, K)
    fp32 -> (M, V) fp32 logits, every one exact to fp32 rounding (the `weight` argument, screened_head.py's, unused).
    `build(weight)`: None where the weight is not a Q8_0 grid or the kernel has no vector path here."""

    def __init__(self, matmul: Q8F32Matmul):
        self.matmul = matmul

    @classmethod
    def build(cls, weight: torch.Tensor) -> Q8Head | None:
        isa = chosen_isa()
        blocks = q8_0_blocks(weight) if isa in VECTOR_ISAS else None
        return cls(Q8F32Matmul(*blocks, isa=isa)) if blocks is not None else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.matmul(x)
        return y if bias is None else y.add_(bias)
