"""Which kernel multiplies a single row (batch-1 decode) by a float weight: timed on the
model's own linear layers at start-up, because the answer differs from CPU to CPU.

Why: at M = 1 the step reads every weight once and the kernel's memory throughput is the
step's speed. One pass over the default model's 538 MB of fp32 linear weights, 2 threads
(docs/benchmarks.md, "The batch-1 linear path"):

| CPU | `split` (bmm over slices) | `linear` (F.linear, MKL GEMV) | `packed` (oneDNN) |
|---|---:|---:|---:|
| the first probe's machine (2026-11) | ~12 ms | ~46 ms | not measured |
| Intel Xeon, AVX-512 + AMX (2026-12-03) | 55.9 ms | 21.8 ms | 30.2 ms |

So no one path wins: `choose` runs a pass over the layers (the leading ones, up to
MAX_TIMED_BYTES of weight) with each candidate (one warm-up pass, then `rounds` interleaved
timed passes, fastest pass each) and every layer takes the winner. The candidates round
differently (their sums run in different orders); within a process every layer uses the one
chosen. `RADIXSERVE_SINGLE_ROW_PATH=split|linear|packed`
skips the timing (the test suite pins it so its numerics do not depend on timing).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

PATHS = ("split", "linear", "packed")
ENV = "RADIXSERVE_SINGLE_ROW_PATH"
# Bytes of weight one timed pass reads at most: larger than any last-level cache seen (480 MB),
# so a pass streams from memory as decode does, and a large model's start-up pays about
# 12 x 1 GB of reads (a fraction of a second to a few seconds) rather than 12 passes over it.
MAX_TIMED_BYTES = 1 << 30


def choose(layers: Sequence, rounds: int = 3, clock: Callable[[], float] = time.perf_counter) -> str | None:
    """Pick the single-row path for `layers` (Linear modules whose `row_paths()` is non-empty)
    and set it on each (`use_row_path`). Candidates are the paths every layer offers. Returns
    the path, or None when there is nothing to choose. Where the environment pins a path these
    layers cannot take (`split` on a bf16 weight), they keep the one `prepare` gave them,
    untimed. Raises ValueError when the environment names an unknown path."""
    layers = [m for m in layers if m.row_paths()]
    if not layers:
        return None
    offered = [p for p in PATHS if all(p in m.row_paths() for m in layers)]
    pinned = os.environ.get(ENV)
    if pinned and pinned not in PATHS:
        raise ValueError(f"{ENV}={pinned!r}: expected one of {PATHS}")
    if pinned:   # where the layers cannot take it (split needs fp32), their default, untimed
        default = layers[0].row_path if layers[0].row_path in offered else offered[0]
        chosen = pinned if pinned in offered else default
        note = f"{ENV}={pinned}" + ("" if chosen == pinned else ", not offered here")
    elif len(offered) == 1:
        chosen, note = offered[0], "the only one"
    else:
        best = _time_paths(timed_prefix(layers, MAX_TIMED_BYTES), offered, rounds, clock)
        chosen = min(best, key=best.get)
        note = ", ".join(f"{p} {1000 * t:.1f} ms" for p, t in best.items())
    for m in layers:
        m.use_row_path(chosen)
    logger.info("single-row linear path: %s (%d layers, a pass: %s)", chosen, len(layers), note)
    return chosen


def timed_prefix(layers: Sequence, max_bytes: int) -> list:
    """The leading layers whose weights add up to `max_bytes` (at least one layer)."""
    total = 0
    for n, m in enumerate(layers):
        total += m.weight.numel() * m.weight.element_size()
        if total >= max_bytes:
            return list(layers[:n + 1])
    return list(layers)


def _time_paths(layers: Sequence, paths: Sequence[str], rounds: int,
                clock: Callable[[], float]) -> dict[str, float]:
    """Fastest time in seconds of one pass over `layers` per path (a warm-up pass first:
    oneDNN builds its primitives on a first call)."""
    inputs = {m.in_features: None for m in layers}
    dtype = layers[0].weight.dtype
    for k in inputs:
        inputs[k] = torch.randn(1, k).to(dtype)
    best = {p: float("inf") for p in paths}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for p in paths:
                for m in layers:
                    m.use_row_path(p)
                start = clock()
                for m in layers:
                    m(inputs[m.in_features])
                if r:
                    best[p] = min(best[p], clock() - start)
    return best
