"""Tensor-parallel layers (vLLM's Column/Row/VocabParallel): which heads and rows a rank holds, cut at load time.

Column-parallel (QKV by heads, gate/up by rows, LM head by vocabulary) needs no collective until the head's all-gather;
row-parallel (o_proj, down_proj) and the vocab-parallel embedding all-reduce their output (docs/parallel.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from radixserve.config_checks import check_experts_fit, check_heads_fit
from radixserve.layers.linear import Linear


class Collectives(Protocol):
    """dist/comm.py's Communicator as the layers see it."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class Heads(NamedTuple):
    """This rank's attention heads: counts and the first q / KV head of the checkpoint it holds."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: Collectives | None) -> Heads:
    """num_heads / size q heads each; KV heads split likewise, or one replicated KV head per rank when
    num_kv_heads < size (then size % num_kv_heads == 0). Raises ValueError when the counts do not divide."""
    if tp is None or tp.size == 1:
        return Heads(num_heads, num_kv_heads, 0, 0)
    size, rank = tp.size, tp.rank
    check_heads_fit(size, num_heads, num_kv_heads)
    heads = num_heads // size
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return Heads(heads, kv, rank * heads, rank * kv)
    return Heads(heads, 1, rank * heads, rank // (size // num_kv_heads))


def split_even(n: int, tp: Collectives) -> tuple[int, int]:
    """(start, length) of this rank's n / size rows; ValueError when size does not divide n."""
    if n % tp.size:
        raise ValueError(f"--tp-size {tp.size} does not divide {n}")
    return tp.rank * (n // tp.size), n // tp.size


class ExpertShard(NamedTuple):
    """Routed experts here: [first, first + count) of the checkpoint's, each's rows [row_start, row_start + rows)."""

    first: int
    count: int
    row_start: int
    rows: int


def shard_experts(num_experts: int, intermediate_size: int, tp: Collectives | None, ep_size: int = 1) -> ExpertShard:
    """Expert parallelism inside the TP group (SGLang's layout): with m = size / ep_size, rank r is expert-parallel
    rank r // m, owning num_experts / ep_size consecutive whole experts, and slices each one's intermediate rows I / m
    ways at r % m (ep_size 1: plain TP). Raises ValueError when ep_size does not divide size, the experts or I / m."""
    if tp is None or tp.size == 1:
        if ep_size != 1:
            raise ValueError(f"--ep-size {ep_size} needs --tp-size >= {ep_size}")
        return ExpertShard(0, num_experts, 0, intermediate_size)
    if ep_size < 1 or tp.size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp.size}")
    check_experts_fit(ep_size, num_experts)
    slices = tp.size // ep_size
    if intermediate_size % slices:
        raise ValueError(f"--tp-size {tp.size} / --ep-size {ep_size} = {slices} does not divide the experts' "
                         f"intermediate size {intermediate_size}")
    count, rows = num_experts // ep_size, intermediate_size // slices
    return ExpertShard(tp.rank // slices * count, count, tp.rank % slices * rows, rows)


def vocab_part(vocab_size: int, tp: Collectives) -> tuple[int, int]:
    """(start, length) of this rank's vocabulary rows: ceil(V / size) each, the last rank's tail past V padded."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


@dataclass(frozen=True)
class TPSplit:
    """The part of a checkpoint tensor one rank holds: `ranges[shard]` = (start, length) along `dim` (0: output rows,
    column-parallel; 1: input columns, row-parallel); an all-shards tensor holds them in equal parts, in order. Rows
    past the tensor's end are zeros (padded vocabulary); a row-parallel bias stays on rank 0 only (added once)."""

    dim: int
    ranges: dict[str | None, tuple[int, int]]
    rank: int

    def local(self, tensor: torch.Tensor, shard: str | None, is_bias: bool) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("tensor parallelism loads float weights only (use --quantization none)")
        if is_bias and self.dim == 1:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        dim = 0 if is_bias else self.dim
        if shard is None and None not in self.ranges:     # a fused checkpoint tensor (GLM's gate_up_proj)
            parts = tensor.chunk(len(self.ranges), dim)
            return torch.cat([self.local(p, s, is_bias) for p, s in zip(parts, self.ranges)], dim=dim)
        start, length = self.ranges[shard]
        have = max(0, min(length, tensor.shape[dim] - start))
        part = tensor.narrow(dim, min(start, tensor.shape[dim]), have)
        if have == length:
            return part
        pad = list(tensor.shape)
        pad[dim] = length - have
        return torch.cat([part, tensor.new_zeros(pad)], dim=dim)


def column_split(linear: Linear, ranges: dict[str | None, tuple[int, int]], tp: Collectives | None) -> Linear:
    """`linear` (built with this rank's output rows) loading `ranges` of each checkpoint shard's rows."""
    if tp is not None and tp.size > 1:
        linear.tp_split = TPSplit(0, ranges, tp.rank)
    return linear


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W[:, part].T) (+ bias once): x (M, in / size) -> (M, out), the same on every rank;
    without `reduce`, the partial sum (a caller adds several and reduces once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Collectives, reduce: bool = True):
        start, length = split_even(in_features, tp)
        super().__init__(length, out_features, bias)
        self.tp, self.reduce = tp, reduce
        self.tp_split = TPSplit(1, {None: (start, length)}, tp.rank)

    def forward(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = super().forward(x, cast_back)
        return self.tp.all_reduce(y) if self.reduce else y


def row_linear(in_features: int, out_features: int, bias: bool, tp: Collectives | None, reduce: bool = True) -> Linear:
    """A plain Linear without tensor parallelism, else its RowParallelLinear."""
    if tp is None or tp.size == 1:
        return Linear(in_features, out_features, bias)
    return RowParallelLinear(in_features, out_features, bias, tp, reduce)


class ParallelLMHead(Linear):
    """LM head over this rank's vocabulary rows: x (R, hidden) -> all-gathered logits (R, vocab_size), pad cut."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: Collectives):
        start, length = vocab_part(vocab_size, tp)
        super().__init__(hidden_size, length)
        self.tp, self.vocab_size = tp, vocab_size
        self.tp_split = TPSplit(0, {None: (start, length)}, tp.rank)

    def forward(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        return self.tp.all_gather(super().forward(x, cast_back), dim=-1)[:, :self.vocab_size]


class VocabParallelEmbedding(torch.nn.Module):
    """weight: this rank's (ceil(V / size), hidden) rows; forward: ids (T,) int64 -> all-reduced (T, hidden)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Collectives):
        super().__init__()
        self.start, length = vocab_part(vocab_size, tp)
        self.tp = tp
        self.tp_split = TPSplit(0, {None: (self.start, length)}, tp.rank)
        self.weight = torch.nn.Parameter(torch.empty(length, hidden_size), requires_grad=False)

    def local_part(self, tensor: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> torch.Tensor:
        return self.tp_split.local(tensor, shard, is_bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(1), 0.0))
