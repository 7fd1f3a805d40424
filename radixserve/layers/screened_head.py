"""A screened LM head for small decode steps of a quantized model: int8 logits for the whole vocabulary, the largest recomputed in fp32.

The exact_top largest int8 logits of each row are recomputed from the fp32 weight (docs/runner.md)."""
from __future__ import annotations

import torch

from radixserve.layers.quant_linear import Int8Matmul, Int8Weight


class ScreenedHead:
    """`weight` (V, K) fp32 stays the caller's; the int8 copy is made here (ValueError if it cannot be packed).
    `__call__(x, weight, bias)`: x (M, K) fp32 -> (M, V) fp32 logits."""

    def __init__(self, weight: torch.Tensor, exact_top: int):
        self.matmul = Int8Matmul([Int8Weight.from_float(weight)])
        self.exact_top = min(exact_top, weight.shape[0])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        logits = self.matmul(x, cast_back=False).float()
        if bias is not None:
            logits.add_(bias)
        top = logits.topk(self.exact_top, dim=-1).indices
        exact = torch.bmm(weight[top], x.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            exact.add_(bias[top])
        return logits.scatter_(1, top, exact)
