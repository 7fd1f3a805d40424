"""The memory-bandwidth ceiling the benchmarks compare against.

A step that must read B bytes of weights from DRAM cannot finish in less than B / bandwidth
seconds, whatever its kernels; `bandwidth_gbs()` measures that bandwidth here.
"""
from __future__ import annotations

import time

import torch


def bandwidth_gbs(gib: int = 1, repeats: int = 5) -> float:
    """DRAM read bandwidth in GB/s (10^9 bytes per second): the median of `repeats` reductions
    over a `gib` GiB fp32 tensor on torch's threads, after one warm pass. Weight-bound steps
    read and hardly write, so a read-only probe is the right ceiling."""
    buf = torch.ones(gib * 2**28, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / sorted(times)[len(times) // 2] / 1e9
