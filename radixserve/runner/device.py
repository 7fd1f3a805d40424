"""Which torch device the runner uses (`--device`), checked once at start-up."""
from __future__ import annotations

import torch


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
