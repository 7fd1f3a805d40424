"""Which torch device the runner uses (`--device`), checked once at start-up, and how CPU buffers are allocated."""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h); 32 MiB is the largest mmap threshold glibc accepts on 64-bit.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20


def resolve_device(name: str | None) -> torch.device:
    """`name`: "cpu", "cuda", "cuda:N", or None (cuda if present). Raises ValueError when it is not there."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"--device {name}: torch {torch.__version__} ({build}) sees no CUDA GPU; "
                             f"use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
    return device


def huge_pages_mb() -> int | None:
    """This process's anonymous memory on transparent huge pages, in MiB (None off Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            line = next((ln for ln in f if ln.startswith("AnonHugePages:")), None)
    except OSError:
        return None
    return int(line.split()[1]) // 1024 if line else None


@functools.cache
def reuse_freed_cpu_buffers() -> bool:
    """Have glibc keep freed blocks up to 32 MiB (256 MiB in all) for reuse, process-wide, unless MALLOC_* are set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        logger.info("malloc thresholds left as the environment sets them")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: freed CPU buffers are returned to the kernel")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.info("mallopt refused the thresholds: freed CPU buffers are returned to the kernel")
        return False
    return True


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros; on CPU a fresh anonymous mapping, zero-filled on first touch, so unwritten pages cost nothing."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
