"""Routed-experts MLP (mixture of experts): the router, the experts grouped by expert, and the shared experts.

Routers as transformers' Qwen3MoeTopKRouter (softmax) and Glm4MoeTopkRouter (sigmoid, DeepSeek-V3's noaux_tc); one
matmul per active expert; a token's expert outputs are summed in ascending expert order, as transformers adds them."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from radixserve.layers import batch_invariant as bi
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.parallel import Collectives, shard_experts
from radixserve.models.block_config import MoEConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
logger = logging.getLogger(__name__)


def _packed(weights: list[torch.Tensor], batch_invariant: bool) -> list[torch.Tensor] | None:
    """oneDNN-packed copies of (N, K) CPU weights; None where packing is unavailable (ValueError if batch_invariant)."""
    if weights[0].device.type != "cpu" and not batch_invariant:
        return None
    try:
        return [bi.pack(w) for w in weights]
    except ValueError:
        if batch_invariant:
            raise
        logger.info("MoE experts: oneDNN packing unavailable for %s; using F.linear", weights[0].dtype)
        return None


class Router(torch.nn.Module):
    """weight (E, hidden) fp32 even in a bf16 model; e_score_correction_bias (E,) fp32, sigmoid scoring only."""

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(config.num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (torch.nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                                        if config.scoring == "sigmoid" else None)
        self._packed: torch.Tensor | None = None

    def prepare(self, batch_invariant: bool = False) -> None:
        self._packed = None
        if batch_invariant:
            dtype = torch.float32 if self.config.scoring == "sigmoid" else self.weight.dtype
            self._packed = bi.pack(self.weight.data.to(dtype))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return bi.matmul(x, self._packed)
        return F.linear(x, self.weight.to(x.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) fp32, expert ids (T, k) int64)."""
        c = self.config
        if c.scoring == "softmax":
            probs = torch.softmax(self._logits(x), dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = self._logits(x.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if c.num_groups > 1:
            grouped = choice.view(-1, c.num_groups, c.num_experts // c.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(
                1, torch.topk(group_scores, c.topk_groups, dim=-1, sorted=False).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(c.num_experts // c.num_groups, 1),
                                        float("-inf"))
        ids = torch.topk(choice, c.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class Experts(torch.nn.Module):
    """This rank's SwiGLU experts stacked: gate_up (E_r, 2I_r, hidden) [gate rows | up rows], down (E_r, hidden, I_r).
    Without parallelism E_r = E, I_r = I. Under tensor parallelism `tp` with `ep_size` expert-parallel ranks
    (layers/parallel.py shard_experts) the rank holds checkpoint experts [first, first + E_r), E_r = E / ep_size,
    with I_r = I * ep_size / size rows each; its output is then a partial sum (tokens routed elsewhere add 0)."""

    def __init__(self, hidden_size: int, config: MoEConfig, tp: Collectives | None = None, ep_size: int = 1):
        super().__init__()
        shard = shard_experts(config.num_experts, config.intermediate_size, tp, ep_size)
        self.num_experts, self.first = config.num_experts, shard.first
        self.rows = (shard.row_start, shard.rows)
        self.intermediate_size = i = shard.rows
        self.gate_up = torch.nn.Parameter(torch.empty(shard.count, 2 * i, hidden_size), requires_grad=False)
        self.down = torch.nn.Parameter(torch.empty(shard.count, hidden_size, i), requires_grad=False)
        self._gate_up_packed: list[torch.Tensor] | None = None
        self._down_packed: list[torch.Tensor] | None = None

    def prepare(self, batch_invariant: bool = False) -> None:
        self._gate_up_packed = _packed(list(self.gate_up.data), batch_invariant)
        self._down_packed = _packed(list(self.down.data), batch_invariant)

    def checkpoint_names(self) -> list[str]:
        return [f"{self.first + e}.{p}" for e in range(self.gate_up.shape[0]) for p in PROJECTIONS]

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """Copy `experts.{expert}.{projection}.weight` into its slice (nothing for another expert-parallel rank's
        expert); ValueError for an unknown one or a wrong shape."""
        i = self.intermediate_size
        if not 0 <= expert < self.num_experts or projection not in PROJECTIONS:
            raise ValueError(f"no expert tensor {expert}.{projection} in a {self.num_experts}-expert layer")
        expert -= self.first
        if not 0 <= expert < self.gate_up.shape[0]:
            return
        target = {"gate_proj": self.gate_up.data[expert, :i], "up_proj": self.gate_up.data[expert, i:],
                  "down_proj": self.down.data[expert]}[projection]
        tensor = tensor.narrow(1 if projection == "down_proj" else 0, *self.rows)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert}.{projection}: checkpoint {tuple(tensor.shape)} vs {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, hidden); weights, ids (T, k) -> (T, hidden) = sum_j weights[:, j] * expert_{ids[:, j]}(x)."""
        if torch.compiler.is_compiling():   # data-dependent (tokens per expert): one opaque op in a compiled graph
            return torch.ops.radixserve.experts(x, weights, ids, self.gate_up, self.down, self.first)
        return grouped_experts(x, weights, ids, self.gate_up, self.down, self._gate_up_packed, self._down_packed,
                               self.first)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, gate_up_packed: list[torch.Tensor] | None = None,
                    down_packed: list[torch.Tensor] | None = None, first: int = 0) -> torch.Tensor:
    """Experts.forward over experts [first, first + E) held as gate_up (E, 2I, hidden), down (E, hidden, I), with
    their oneDNN-packed copies if given; (token, expert) pairs outside that range add nothing."""
    num_tokens, k = ids.shape
    local = gate_up.shape[0]
    flat = ids.reshape(-1) - first
    flat = flat.masked_fill((flat < 0) | (flat >= local), local)    # another rank's experts sort last, dropped
    counts = torch.bincount(flat, minlength=local + 1).tolist()[:local]
    order = torch.argsort(flat, stable=True)[:sum(counts)]
    token_of = order // k
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = rows[start:start + count]
            if gate_up_packed is not None and down_packed is not None:
                hidden = silu_and_mul(bi.matmul(part, gate_up_packed[expert]))
                out[start:start + count] = bi.matmul(hidden, down_packed[expert])
            else:
                hidden = silu_and_mul(F.linear(part, gate_up[expert]))
                out[start:start + count] = F.linear(hidden, down[expert])
            start += count
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


@torch.library.custom_op("radixserve::experts", mutates_args=())
def experts_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, first: int = 0) -> torch.Tensor:
    """grouped_experts on the plain weights, as one op a compiled graph calls (runner/compiled_decode.py)."""
    return grouped_experts(x, weights, ids, gate_up, down, first=first)


@experts_op.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
      down: torch.Tensor, first: int = 0) -> torch.Tensor:
    return torch.empty_like(x)


class MoE(torch.nn.Module):
    """Router (replicated, fp32: every rank routes alike) + experts (+ shared experts, a plain MLP `shared_mlp` built by
    the model; under `tp` one whose down_proj does not reduce), then one all-reduce of their partial sums; with
    `ep_size` > 1 the routed experts are split whole between expert-parallel ranks (Experts), the same all-reduce."""

    def __init__(self, hidden_size: int, config: MoEConfig, shared_mlp: torch.nn.Module | None,
                 tp: Collectives | None = None, ep_size: int = 1):
        super().__init__()
        self.gate = Router(hidden_size, config)
        self.experts = Experts(hidden_size, config, tp, ep_size)
        self.shared_experts = shared_mlp
        self.tp = tp if tp is not None and tp.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        out = out if self.shared_experts is None else out + self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)
