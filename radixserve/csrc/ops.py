"""radixserve/csrc's library (radixserve::int4_int8_mm, int4_fp32_mm, decode_attention): loaded once, fake kernels
for torch.compile, and each op's ISA path chosen from what this CPU runs."""
from __future__ import annotations

import functools
import logging
import os

import torch

from radixserve.csrc import LIBRARY

logger = logging.getLogger(__name__)


def _mm_fake(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, isa: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)   # every matmul op: (x (M, K) fp32, packed, scales, n, isa) -> (M, n) fp32


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, isa: int) -> torch.Tensor:
    return torch.empty_like(q)


def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                          lens: torch.Tensor, isa: int) -> torch.Tensor:
    return torch.empty_like(q)


# op -> its fake kernel (shapes and dtypes only), for torch.compile
FAKES = {"int4_int8_mm": _mm_fake, "int4_fp32_mm": _mm_fake, "decode_attention": _attention_fake,
         "decode_attention_paged": _paged_attention_fake,
         "q8_fp32_mm": _mm_fake}


@functools.cache
def library_loaded() -> bool:
    """Whether the built library is loaded (its ops registered, with fakes); logged once when it is not."""
    if not LIBRARY.exists():
        logger.warning("C++ kernels: %s not built (python -m radixserve.csrc.build); using their torch forms", LIBRARY)
        return False
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as exc:
        logger.warning("C++ kernels: cannot load %s (%s); using their torch forms", LIBRARY, exc)
        return False
    for op, fake in FAKES.items():
        if has_op(op):
            torch.library.register_fake(f"radixserve::{op}")(fake)
    return True


@functools.cache
def has_op(op: str) -> bool:
    """Whether the loaded library defines `op` (a library built before the op was added does not: logged once)."""
    if hasattr(torch.ops.radixserve, op):
        return True
    logger.warning("C++ kernels: %s lacks radixserve::%s (built before it was added; rebuild with python -m "
                   "radixserve.csrc.build); using its torch form", LIBRARY, op)
    return False


def supported_isas(op: str, isas: tuple[str, ...]) -> tuple[str, ...]:
    """The paths of `op` (isas[i] is its ISA number i; "scalar" first) this CPU runs; () without the op built."""
    if not library_loaded() or not has_op(op):
        return ()
    supported = getattr(torch.ops.radixserve, f"{op.removesuffix('_mm')}_supported")
    return tuple(name for i, name in enumerate(isas) if supported(i))


def choose_isa(mode: str, op: str, isas: tuple[str, ...], env: str) -> str | None:
    """$`env` if this CPU runs it, else the widest path; None: the torch reference (logged once by the caller's cache)."""
    have = supported_isas(op, isas)
    wanted = os.environ.get(env)
    if wanted and wanted not in have:
        logger.warning("%s: %s=%s not available here (have %s)", mode, env, wanted, ", ".join(have) or "none")
    isa = wanted if wanted in have else (have[-1] if have else None)
    if isa != isas[-1]:
        logger.info("%s: running the %s path", mode, isa or "torch reference")
    return isa
