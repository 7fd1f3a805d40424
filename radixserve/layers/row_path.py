"""Which kernel multiplies one row by a float weight: timed on the model's linear layers at start-up (the fastest
differs by CPU), kept per machine so its servers round alike (docs/runner.md); RADIXSERVE_SINGLE_ROW_PATH pins it."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Callable, Sequence

import torch

from radixserve.config import cache_root

logger = logging.getLogger(__name__)

PATHS = ("split", "linear", "packed")
ENV = "RADIXSERVE_SINGLE_ROW_PATH"
# Weight bytes a timed pass reads at most: above any last-level cache seen (480 MB), so it streams as decode does.
MAX_TIMED_BYTES = 1 << 30


def choose(layers: Sequence, rounds: int = 3, clock: Callable[[], float] = time.perf_counter) -> str | None:
    """Set the fastest single-row path all `layers` offer on each, return it (None: none); ValueError: unknown pin."""
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
        chosen, note = _kept_or_timed(timed_prefix(layers, MAX_TIMED_BYTES), offered, rounds, clock)
    for m in layers:
        m.use_row_path(chosen)
    logger.info("single-row linear path: %s (%d layers; %s)", chosen, len(layers), note)
    return chosen


def cpu_identity() -> dict[str, str]:
    """This CPU's model name and flags from /proc/cpuinfo ({} without it), in any key for choices a CPU can change."""
    cpu = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "flags") and name.strip() not in cpu:
                cpu[name.strip()] = value.strip()
    return cpu


def decision_key(layers: Sequence, offered: Sequence[str]) -> str:
    """What a decision depends on: the CPU (model name and flags), torch, its threads, the timed layers' shapes."""
    cpu = cpu_identity()
    shapes = [(m.out_features, m.in_features, str(m.weight.dtype)) for m in layers]
    what = [cpu, torch.__version__, torch.get_num_threads(), shapes, list(offered)]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked_decisions() -> Iterator[tuple[dict, Callable[[dict], None]] | None]:
    """The machine's decisions {key: path} and a saver, under an exclusive lock; None where the cache dir is unusable."""
    folder = cache_root()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / "row_path.lock", "a")
    except OSError as exc:
        logger.info("single-row path not kept: %s unusable (%s)", folder, exc)
        yield None
        return
    path = folder / "row_path.json"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            decisions = json.loads(path.read_text())
            decisions = decisions if isinstance(decisions, dict) else {}
        except (OSError, ValueError):
            decisions = {}

        def save(new: dict) -> None:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(new, indent=1, sort_keys=True))
            tmp.replace(path)
        yield decisions, save


def _kept_or_timed(layers: Sequence, offered: Sequence[str], rounds: int,
                   clock: Callable[[], float]) -> tuple[str, str]:
    """The path this machine decided for these layers before, else the fastest now, kept for next time."""
    key = decision_key(layers, offered)
    with _locked_decisions() as kept:
        if kept is not None and kept[0].get(key) in offered:
            return kept[0][key], f"kept in {cache_root() / 'row_path.json'}"
        best = _time_paths(layers, offered, rounds, clock)
        chosen = min(best, key=best.get)
        if kept is not None:
            with contextlib.suppress(OSError):
                kept[1]({**kept[0], key: chosen})
        return chosen, "a pass: " + ", ".join(f"{p} {1000 * t:.1f} ms" for p, t in best.items())


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
                    m.local_forward(inputs[m.in_features])
                if r:
                    best[p] = min(best[p], clock() - start)
    return best
