"""int4 weights x int8 activations on the CPU: radixserve/csrc/int4_int8.cpp, or reference_mm, its bit-identical torch
form. w = d * q + mn per 32 columns; activations int8 per row and 32 columns; each output row in a fixed fp32 order that
depends on that row alone (batch-invariant). Numerics and layout: docs/runner.md, "int4-int8"."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from radixserve.csrc import ops as csrc_ops

BLOCK = 32
COLS = 16
ISAS = ("scalar", "avx2", "avx512_vnni")
ISA_ENV = "RADIXSERVE_INT4_INT8_ISA"
_REFERENCE_ROWS = 256


def supported_isas() -> tuple[str, ...]:
    """The kernel's paths this CPU runs ("scalar" first); () without the built library."""
    return csrc_ops.supported_isas("int4_int8_mm", ISAS)


@functools.cache
def chosen_isa() -> str | None:
    """$RADIXSERVE_INT4_INT8_ISA if this CPU runs it, else the widest path; None: the torch reference (logged once)."""
    return csrc_ops.choose_isa("int4-int8", "int4_int8_mm", ISAS, ISA_ENV)


def block_params(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, mn) of w = d * q + mn from an Int4Weight's (scale, zero) of w = (q - 8) * scale + zero; (N, K / 32) fp32."""
    return scale.float(), zero.float() - 8 * scale.float()


def pack(codes: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) uint8, d, mn (N, K / 32) -> packed (ceil(N / 16), K / 32, 4, 64) uint8, scales (.., 2, 16)."""
    n, k = codes.shape
    pad = -n % COLS
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).view(-1, COLS, k // BLOCK, 8, 4)
    words = codes.permute(0, 2, 3, 1, 4)   # (G, B, word, column, byte)
    packed = (words[:, :, :4] | (words[:, :, 4:] << 4)).reshape(-1, k // BLOCK, 4, 64).contiguous()
    scales = torch.stack([torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (d, mn)], dim=-1)
    if torch.equal(scales.half().float(), scales):
        scales = scales.half()
    return packed, scales.view(-1, COLS, k // BLOCK, 2).permute(0, 2, 3, 1).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> q8 (M, K / 32, 32) fp32 integers, dx = amax / 127, sxf = dx * sum(q8) (M, K / 32) per block."""
    xb = x.reshape(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(dim=-1)
    dx = amax / 127.0
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q8 = torch.round(xb * inv[..., None]).clamp_(-127, 127)
    return q8, dx, dx * q8.sum(dim=-1)


def reference_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32, codes (N, K) uint8, d, mn (N, K / 32) fp32 -> (M, N) fp32, bit for bit the kernel's result."""
    out = torch.empty(x.shape[0], codes.shape[0])
    qw = codes.float().view(codes.shape[0], -1, BLOCK).permute(1, 2, 0)   # (B, 32, N)
    for r0 in range(0, x.shape[0], _REFERENCE_ROWS):
        q8, dx, sxf = quantize_rows(x[r0:r0 + _REFERENCE_ROWS].float())
        isum = torch.bmm(q8.transpose(0, 1), qw)
        acc = torch.zeros(q8.shape[0], codes.shape[0])
        for b in range(isum.shape[0]):
            acc = acc + (d[:, b] * (isum[b] * dx[:, b, None]) + mn[:, b] * sxf[:, b, None])
        out[r0:r0 + _REFERENCE_ROWS] = acc
    return out


class OwnInt4Matmul:
    """x (M, K) @ W.T -> (M, N), W the Int4Weight shards stacked, on radixserve's op OP at `isa` (None: REFERENCE, its
    bit-identical torch form); ValueError on bad K or an ISA this CPU lacks. Subclasses name the op and its helpers."""

    BATCH_INVARIANT = True
    MODE = OP = ""
    ISAS: tuple[str, ...] = ()
    reference: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    chosen_isa: Callable[[], str | None]
    supported_isas: Callable[[], tuple[str, ...]]

    def __init__(self, weights: list, isa: str | None = "auto"):
        if len({w.codes.shape[1] for w in weights}) != 1 or weights[0].codes.shape[1] % BLOCK:
            raise ValueError(f"{self.MODE} shards of one layer must share their columns, a multiple of 32")
        codes = torch.cat([w.codes for w in weights])
        d, mn = block_params(torch.cat([w.scale for w in weights]), torch.cat([w.zero for w in weights]))
        self.n = codes.shape[0]
        self.isa = self.chosen_isa() if isa == "auto" else isa
        if self.isa is not None and self.isa not in self.supported_isas():
            raise ValueError(f"{self.MODE} path {self.isa!r} not available here (have {self.supported_isas()})")
        if self.isa is None:
            self.codes, self.d, self.mn = codes, d, mn
        else:
            self.packed, self.scales = pack(codes, d, mn)
            self.op, self.isa_index = getattr(torch.ops.radixserve, self.OP), self.ISAS.index(self.isa)

    def __call__(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        xf = x.float()
        if self.isa is None:
            y = self.reference(xf, self.codes, self.d, self.mn)
        else:
            y = self.op(xf, self.packed, self.scales, self.n, self.isa_index)
        return y.to(x.dtype) if cast_back else y


class Int4Int8Matmul(OwnInt4Matmul):
    """int8 activations per row and block (module docstring)."""

    MODE, OP, ISAS = "int4-int8", "int4_int8_mm", ISAS
    reference = staticmethod(reference_mm)
    chosen_isa = staticmethod(chosen_isa)
    supported_isas = staticmethod(supported_isas)
