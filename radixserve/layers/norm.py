"""RMSNorm (Zhang & Sennrich 2019) computed in fp32 like transformers' LlamaRMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dim; x: (..., hidden) -> same shape/dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalise in fp32, cast back, then scale (transformers' order).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
