"""Which kernel multiplies a single row (batch-1 decode) by a float weight: timed on the model's own linear layers at
start-up, as the fastest differs from CPU to CPU (docs/runner.md); `RADIXSERVE_SINGLE_ROW_PATH` pins it untimed."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

PATHS = ("split", "linear", "packed")
ENV = "RADIXSERVE_SINGLE_ROW_PATH"
# Weight bytes a timed pass reads at most: above any last-level cache seen (480 MB), so it streams as decode does.
MAX_TIMED_BYTES = 1 << 30


def choose(layers: Sequence, rounds: int = 3, clock: Callable[[], float] = time.perf_counter) -> str | None:
    """Set the fastest single-row path all `layers` offer on each and return it (None: none to choose); ValueError for
    an unknown pinned path."""
    layers = [m for m in layers if m.row_paths()]
    if not layers:
        return None
    offered = [p for p in PATHS if all(p in m.row_paths() for m in layers)]
    pinned = os.environ.get(ENV)
    if pinned and pinned not in PATHS:
        raise ValueError(f"{ENV}={pinned!r}: expected one of {PATHS}")
    if pinned:
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
    total = 0
    for n, m in enumerate(layers):
        total += m.weight.numel() * m.weight.element_size()
        if total >= max_bytes:
            return list(layers[:n + 1])
    return list(layers)


def _time_paths(layers: Sequence, paths: Sequence[str], rounds: int,
                clock: Callable[[], float]) -> dict[str, float]:
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
