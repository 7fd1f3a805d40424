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

# glibc's mallopt parameters (malloc.h) and the values set by reuse_freed_cpu_buffers.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20    # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 256 << 20


def resolve_device(name: str | None) -> torch.device:
    """`name`: "cpu", "cuda" or "cuda:N"; None picks cuda when torch sees a GPU, else cpu.
    Raises ValueError, with what torch reports, when the named device is not there."""
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
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of returning them
    to the kernel, so the activations of one step reuse the last step's memory. torch's CPU
    tensors come from malloc; by default glibc serves blocks above its mmap threshold with fresh
    mappings, so every step faults in new pages (with transparent huge pages, 2 MiB pages the
    kernel must zero, sometimes compact). Measured: a (1024, 3072) bf16 -> fp32 cast 11-13 ms
    before, 0.2 ms after; fp32 prefill steps 1.0-1.3x faster (docs/benchmarks.md). The cost:
    up to 256 MiB of freed memory stays in the process. Process-wide, applied once; a
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ set by the user is kept. Returns whether
    it applied (False off glibc, logged once)."""
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
    """A zero tensor of `shape` and `dtype`. On CPU it lies on its own anonymous mapping, which
    the kernel zero-fills page by page on first touch: pages never written cost nothing (a read
    maps the shared zero page), where torch.zeros writes, and so faults in, every page first
    (about 1.4 ms per MB on a 2-core VM, docs/benchmarks.md). With THP_MEM_ALLOC_ENABLE=1
    (radixserve's default) the mapping asks for transparent huge pages, as torch's own large
    buffers do. The tensor keeps the mapping alive. For large buffers of which much may stay
    unwritten (the decode mirror's spare capacity); the KV pool stays torch.zeros, so its pages
    are faulted in at start-up rather than under the first requests."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
