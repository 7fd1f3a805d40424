"""A screened LM head for small decode steps of a quantized model: int8 logits for the whole vocabulary, the largest recomputed in fp32.

Why: at batch 1 the head (vocab x hidden, a third of the default model's bytes per token) is
the largest single read of a quantized model's decode step. An int8 copy reads a quarter of
the fp32 bytes (49152 x 576: 0.4-0.5 ms against 1.5-1.6 ms at one row, AVX-512 EPYC, 2 threads;
docs/benchmarks.md). Its logits are coarse: per-row int8 weights, bf16 activations and a bf16
output put them within ~0.06 of fp32 on average and ~0.8 at worst on the default model. So the
`exact_top` largest screened logits of each row are recomputed from the fp32 weight, and only
the tail keeps the screened values:

    logits[r] = screened[r]                       (every token)
    logits[r, top] = weight[top] @ x[r] (+ bias)  (top = the exact_top largest screened)

Greedy picks are fp32's whenever fp32's argmax ranks within the screened top (on the default
model it ranked first or second in every decode state measured), the chosen token's logit is
fp32's, and its log-probability differs only through the tail's share of the normaliser.
"""
from __future__ import annotations

import torch

from radixserve.layers.quant_linear import Int8Matmul, Int8Weight


class ScreenedHead:
    """y = x @ weight.T (+ bias) for a few rows, screened in int8 with the top recomputed.

    `weight`: (V, K) float32, kept by the caller (the fp32 head); its int8 copy (V x K bytes
    plus 2 bytes a row) is made here. `__call__(x, weight, bias)`: x (M, K) float32 -> (M, V)
    float32 logits as the module docstring says. Raises ValueError (from Int8Matmul) when the
    weight cannot be packed.
    """

    def __init__(self, weight: torch.Tensor, exact_top: int):
        self.matmul = Int8Matmul([Int8Weight.from_float(weight)])
        self.exact_top = min(exact_top, weight.shape[0])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        logits = self.matmul(x, cast_back=False).float()                    # (M, V) screened
        if bias is not None:
            logits.add_(bias)
        top = logits.topk(self.exact_top, dim=-1).indices                   # (M, k)
        exact = torch.bmm(weight[top], x.unsqueeze(-1)).squeeze(-1)         # (M, k, K) @ (M, K, 1)
        if bias is not None:
            exact.add_(bias[top])
        return logits.scatter_(1, top, exact)
