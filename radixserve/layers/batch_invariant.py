"""Batch-invariant matmul for `--enable-deterministic-inference`: row i of X @ W.T has the same bits whatever the other rows of X are.

oneDNN takes its blocking from the prepacked weight, not from M as MKL does; why and how it is checked: docs/runner.md."""
from __future__ import annotations

import torch

PACK_BATCH_HINT = 32   # oneDNN's batch-size hint for the packed layout; constant so layouts never vary


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) on the CPU -> oneDNN-packed for `matmul`. Raises ValueError where oneDNN cannot pack it."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"batch-invariant matmul needs oneDNN on the CPU (weight on {weight.device})")
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
    except (RuntimeError, AttributeError) as exc:
        raise ValueError(f"batch-invariant matmul: oneDNN cannot pack a {weight.dtype} weight here ({exc})") from exc


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ W.T (+ bias) -> (M, N); M == 1 runs as the row twice, taking the kernel of every M >= 2."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def check_row_invariance(dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError unless `matmul` rows and `torch.bmm` items have the same bits alone and inside batches."""
    if device.type != "cpu":
        raise ValueError(f"--enable-deterministic-inference runs on the CPU only (device {device}); "
                         f"no batch-invariant kernels exist here for other devices yet")
    gen = torch.Generator().manual_seed(0)
    for k, n in ((64, 17), (96, 200), (576, 960), (1536, 64)):   # K > 1024: oneDNN's M == 1 kernel differs on some CPUs
        weight = torch.randn(n, k, generator=gen).to(dtype)
        rows = torch.randn(70, k, generator=gen).to(dtype)
        packed = pack(weight)
        alone = matmul(rows[:1], packed)
        for m in (2, 5, 33, 70):
            for pos in (0, m // 2, m - 1):
                batch = torch.cat([rows[1:1 + pos], rows[:1], rows[1 + pos:m]])
                if not torch.equal(matmul(batch, packed)[pos:pos + 1], alone):
                    raise ValueError(f"--enable-deterministic-inference: oneDNN matmul is not batch-"
                                     f"invariant on this CPU for {dtype} ({k}x{n}, M={m}, row {pos})")
    for group, dim, keys in ((1, 64, 64), (4, 64, 320), (3, 128, 128)):
        q = torch.randn(70, group, dim, generator=gen).to(dtype)
        k = torch.randn(keys, dim, generator=gen).to(dtype)
        alone = torch.bmm(q[:1], k.t()[None])
        for m in (2, 5, 33, 70):
            stacked = torch.randn(m, keys, dim, generator=gen).to(dtype)
            stacked[m // 2] = k
            expanded = torch.bmm(q[:m], k.t().expand(m, dim, keys))
            mixed = torch.bmm(torch.cat([q[1:1 + m // 2], q[:1], q[1 + m // 2:m]]), stacked.transpose(1, 2))
            if not (torch.equal(expanded[:1], alone) and torch.equal(mixed[m // 2:m // 2 + 1], alone)):
                raise ValueError(f"--enable-deterministic-inference: torch.bmm is not batch-invariant "
                                 f"on this CPU for {dtype} ({group}x{dim} @ {dim}x{keys}, {m} items)")
