"""SwiGLU activation (Shazeer 2020) over a fused gate-up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * I) = [gate | up] -> silu(gate) * up: (T, I), same dtype."""
    half = gate_up.shape[-1] // 2
    out = F.silu(gate_up[..., :half])
    return out.mul_(gate_up[..., half:])
