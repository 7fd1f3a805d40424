"""Decode attention on the CPU by radixserve/csrc/decode_attention.cpp (`radixserve::decode_attention`) for fp32 KV.

out[b, h] = softmax(q[b, h] . k[b, h // (H / KV), :lens[b]] / sqrt(D)) @ v[b, h // (H / KV), :lens[b]], fp32, with max
subtraction. Paths: "avx512" (D % 16 == 0), "avx2" (D % 8 == 0, with FMA), else "scalar" (std::exp); chosen from what
this CPU supports, or $RADIXSERVE_DECODE_ATTENTION_ISA ("sdpa": never use the kernel). Elsewhere (library not built,
other dtype or device) callers keep SDPA; `runs` says which (logged once)."""
from __future__ import annotations

import functools
import logging
import os

import torch

from radixserve.csrc import ops
from radixserve.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512")
ISA_ENV = "RADIXSERVE_DECODE_ATTENTION_ISA"
EXP_REL_ERROR = 2e-7   # relative, of the vector paths' exp on [-87, 0]; inputs below count as -87 (docs/runner.md)
OUTPUT_TOL = 2e-5   # every output element's distance from SDPA's, per unit of max|v| (test_decode_attention_kernel.py)


def supported_isas() -> tuple[str, ...]:
    """The kernel's paths this CPU runs ("scalar" first); () without the built library."""
    return ops.supported_isas("decode_attention", ISAS)


@functools.cache
def chosen_isa() -> str | None:
    """$RADIXSERVE_DECODE_ATTENTION_ISA if this CPU runs it, else the widest path; None: SDPA."""
    if os.environ.get(ISA_ENV) == "sdpa":
        logger.info("decode attention: %s=sdpa, using SDPA", ISA_ENV)
        return None
    return ops.choose_isa("decode attention", "decode_attention", ISAS, ISA_ENV)


@functools.cache
def runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode attention over a KV of `dtype` on `device` runs the kernel (else SDPA; logged once per pair)."""
    isa = chosen_isa() if device.type == "cpu" and dtype == torch.float32 else None
    logger.info("decode attention over %s on %s: %s", dtype, device, f"the {isa} kernel" if isa else "SDPA")
    return isa is not None


def decode_attention_lens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                          isa: str | None = None) -> torch.Tensor:
    """q (B, H, D) fp32, k and v (B, KV, L, D) fp32 CPU views with unit stride in D and equal strides, lens (B,) int64
    in [1, L] -> (B, H, D) fp32; position t of row b is read iff t < lens[b]. Only where `runs` is True."""
    return torch.ops.radixserve.decode_attention(q, k, v, lens, ISAS.index(isa or chosen_isa()))


def paged_runs(kv: object) -> bool:
    """Whether `decode_attention_paged` can read `kv` (the step's KV cache, any kind) in place: a plain KVCache with
    separate K and V, a compute dtype `runs` takes (fp32), stored as that or bf16 (not FP8)."""
    stored = kv.dtype if isinstance(kv, KVCache) else None
    return (stored is not None and not kv.latent and stored in (kv.compute_dtype, torch.bfloat16)
            and runs(kv.compute_dtype, kv.device) and ops.has_op("decode_attention_paged"))


def decode_attention_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                           lens: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """q (B, H, D) fp32; k, v (KV, P, S, D) fp32 or bf16 cache pages (KVCache.kernel_view) with unit stride in D and
    equal strides; page_table (B, M) int64 page ids in [0, P); lens (B,) int64 in [1, M * S] -> (B, H, D) fp32, token t
    of row b read from row t % S of page page_table[b, t // S]; the same arithmetic as decode_attention_lens, bf16 read
    as its exact fp32 values. Only where `runs` is True. RuntimeError on a page id or length out of its range."""
    return torch.ops.radixserve.decode_attention_paged(q, k, v, page_table, lens, ISAS.index(isa or chosen_isa()))


def paged_op() -> tuple[torch._ops.OpOverload, int]:
    """(op, isa): op(q, k, v, page_table, lens, isa) is decode_attention_paged with the chosen ISA, without its Python
    wrapper, for a caller that binds both once per step and calls the op once per layer."""
    return torch.ops.radixserve.decode_attention_paged.default, ISAS.index(chosen_isa())


def fast_exp(x: torch.Tensor, isa: str) -> torch.Tensor:
    """The vector path `isa`'s exp on x (fp32, contiguous), for tests of EXP_REL_ERROR."""
    assert supported_isas(), "radixserve/csrc not built"
    return torch.ops.radixserve.decode_attention_exp(x, ISAS.index(isa))
