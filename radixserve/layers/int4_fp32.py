"""int4 weights x fp32 activations on the CPU: radixserve/csrc/int4_fp32.cpp, or reference_mm, its bit-identical torch
form. w = d * q + mn per 32 columns (int4_int8.py's block_params and pack); per output and block b,
dot_b = block_sum(q * x), xs_b = block_sum(x), acc = acc + (d * dot_b + mn * xs_b) over the blocks in order, where
block_sum adds 32 values as four partial sums over k % 4 (each in k order, from its first term) combined as
(s0 + s1) + (s2 + s3). Every mul and add rounds to fp32 once, none fused into an FMA, so every ISA path and the
reference agree bit for bit; a row's result reads only that row (batch-invariant). docs/runner.md, "int4-fp32"."""
from __future__ import annotations

import functools

import torch

from radixserve.csrc import ops as csrc_ops
from radixserve.layers.int4_int8 import BLOCK, OwnInt4Matmul

ISAS = ("scalar", "avx2", "avx512")
VECTOR_ISAS = ISAS[1:]   # the paths --quantization auto serves (the scalar one is slower than fp32 dense)
ISA_ENV = "RADIXSERVE_INT4_FP32_ISA"
_REFERENCE_ROWS = 32


def supported_isas() -> tuple[str, ...]:
    """The kernel's paths this CPU runs ("scalar" first); () without the built library."""
    return csrc_ops.supported_isas("int4_fp32_mm", ISAS)


@functools.cache
def chosen_isa() -> str | None:
    """$RADIXSERVE_INT4_FP32_ISA if this CPU runs it, else the widest path; None: the torch reference (logged once)."""
    return csrc_ops.choose_isa("int4-fp32", "int4_fp32_mm", ISAS, ISA_ENV)


def block_sum(v: torch.Tensor) -> torch.Tensor:
    """v (..., 32) -> (...): the kernel's fixed order of adding a block's 32 values."""
    s = v[..., 0:4]
    for i in range(1, BLOCK // 4):
        s = s + v[..., 4 * i:4 * i + 4]
    return (s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])


def reference_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) fp32, codes (N, K) uint8 (int8 for q8_fp32.py), d, mn (N, K / 32) fp32 -> (M, N) fp32, bit for bit
    the kernel's result; mn None (q8_fp32.py's kernel): acc = acc + d * dot_b."""
    out = torch.empty(x.shape[0], codes.shape[0])
    qw = codes.float().view(codes.shape[0], -1, BLOCK)   # (N, B, 32)
    for r0 in range(0, x.shape[0], _REFERENCE_ROWS):
        xb = x[r0:r0 + _REFERENCE_ROWS].float().reshape(-1, qw.shape[1], BLOCK)   # (R, B, 32)
        part = [xb[:, None, :, k] * qw[:, :, k] for k in range(4)]   # (R, N, B) each
        for k in range(4, BLOCK):
            part[k % 4] = part[k % 4] + xb[:, None, :, k] * qw[:, :, k]
        dot = (part[0] + part[1]) + (part[2] + part[3])
        xs = block_sum(xb) if mn is not None else None   # (R, B)
        acc = torch.zeros(xb.shape[0], codes.shape[0])
        for b in range(qw.shape[1]):
            term = d[:, b] * dot[:, :, b]
            acc = acc + (term if mn is None else term + mn[:, b] * xs[:, b, None])
        out[r0:r0 + _REFERENCE_ROWS] = acc
    return out


class Int4F32Matmul(OwnInt4Matmul):
    """fp32 activations (module docstring); no float copy of W is kept."""

    FLOAT_COPY_DTYPE = torch.float32   # a --quantized-max-tokens copy stays fp32: numerics stay fp32-class
    MODE, OP, ISAS = "int4-fp32", "int4_fp32_mm", ISAS
    reference = staticmethod(reference_mm)
    chosen_isa = staticmethod(chosen_isa)
    supported_isas = staticmethod(supported_isas)
