"""Batch-invariant matmul for `--enable-deterministic-inference`: row i of X @ W.T has the same bits whatever the other rows of X are.

Why a separate path: on CPU, MKL's sgemm (`F.linear`, `torch.matmul`) picks its kernel and
blocking by the number of rows M, so one token's activations differ in the last bits between
M = 1 and M = 4. Sampling turns such 1e-6 differences into different tokens (a seeded draw
near a CDF boundary, a near-tie under greedy), so a request's output would depend on what else
was batched. oneDNN's matmul over a weight prepacked by `torch.ops.mkldnn._reorder_linear_weight`
takes its blocking from the packed weight instead: on torch 2.13 (AVX2 EPYC, fp32) every row of
every M in 1..700, at every row position and for every layer shape we serve, was bit-identical
to the same row computed alone (MKL differed for every M >= 2). On an AVX-512 EPYC (Zen 4,
torch 2.13) oneDNN takes another kernel for M == 1 when K > 1024: that row differs from the same
row at every M >= 2, while all M in 2..300 agree; so `matmul` runs a single row as two.
Row-wise ops (softmax, log-softmax, cumsum, sort, RMSNorm, elementwise) were row-invariant in
the same probe and need nothing. Batched matmul (`torch.bmm`) whose items all have one shape
gave each item the same bits whatever the number of items, the item's position, and whether an
operand was stacked or expanded from one tensor; the batch-invariant attention relies on that.

These are empirical properties of a library build on a CPU, so `check_row_invariance` verifies
them at start-up for the dtype at hand and deterministic mode is refused where they do not hold.

Source of the idea (batch-invariant matmul, attention and norms): Horace He and Thinking Machines
Lab, "Defeating Nondeterminism in LLM Inference" (2025); SGLang's `--enable-deterministic-inference`.
"""
from __future__ import annotations

import torch

PACK_BATCH_HINT = 32   # oneDNN's batch-size hint for the packed layout; constant so layouts never vary


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) on the CPU -> an opaque oneDNN-packed weight for `matmul`.
    Raises ValueError where oneDNN cannot pack it (not CPU, no oneDNN, bf16 without AVX-512/AVX-NE)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"batch-invariant matmul needs oneDNN on the CPU (weight on {weight.device})")
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
    except (RuntimeError, AttributeError) as exc:
        raise ValueError(f"batch-invariant matmul: oneDNN cannot pack a {weight.dtype} weight here ({exc})") from exc


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ W.T (+ bias) -> (M, N) in x's dtype, W packed by `pack`. M == 1 runs as
    the row twice, so it takes the same kernel as every M >= 2 (see the module docstring)."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def check_row_invariance(dtype: torch.dtype, device: torch.device) -> None:
    """Verify on this machine that `matmul` rows and `torch.bmm` items do not depend on the
    batch: a row (item) computed alone must equal the same row (item) inside batches of several
    sizes, at several positions, and for bmm with the operand expanded instead of stacked.
    Raises ValueError naming what failed (deterministic inference must then be refused)."""
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
    # bmm in the layouts the batch-invariant attention uses: keys (L, D) row-major read transposed.
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
