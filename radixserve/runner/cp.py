"""Context-parallel prefill (--cp-size R): every rank holds the whole model and runs 1/R of a prefill step's tokens.

    step rows g = 0 .. N-1 (all sequences' new tokens, build_step's order)
    round-robin: row g -> rank g % R, local row g // R;  each rank runs M = ceil(N / R) rows (a short rank pads with
    row 0, whose output is dropped)
    per layer:  k|v (M, 2KV, D) ──all_gather──► (R*M) ──order──► (N) rows: every rank writes ALL new tokens' KV at the
                step's slots, then attends its own queries over each sequence's whole context (cached prefix included);
                MLA's latent layout (V = K) gathers k (M, 1, r + rope) only
    end:        each rank's logit rows (padded to K per rank) ──all_gather──► the step's logit rows, in order

A step without prefill (every query one token: decode) runs unsplit: every rank computes the whole step, so every rank's
cache stays whole (no collective). Round-robin rather than zigzag (docs/parallel.md): any batch of any lengths splits
with no per-sequence bookkeeping, causal work per rank differs by at most one row's context, and LayerSplit needs it.
Attention is computed here (CPAttention), not by the runner's backends: they assume a sequence's queries are its last
rows in one contiguous block, which a rank's round-robin rows are not."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.dist.comm import Communicator
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.kv_sizing import num_pages
from radixserve.runner.layer_split import LayerSplit
from radixserve.runner.model_runner import ModelRunner

# CPAttention's query rows per SDPA: each block reads keys only up to its last row's position, so a rank's
# interleaved rows cost about the causal half of (rows x context), not all of it
QUERY_BLOCK = 256


@dataclass(frozen=True, slots=True)
class SeqRows:
    """One sequence's rows on this rank: local (n,) int64 row indices, positions (n,) int64, its context's page ids
    (pages,) int64 and context length in tokens."""

    local: torch.Tensor
    positions: torch.Tensor
    page_ids: torch.Tensor
    context_len: int


@dataclass(frozen=True, slots=True)
class CPSplit:
    """This rank's share of one step. rows (M,) int64: global rows it runs; order (N,) int64 into the all-gathered
    (R*M) rows, None when unsplit; logit_local (K,) int64: local rows of its logit rows; logit_order into the
    all-gathered (R*K) logits; prefix_pages: distinct pages of the step's cached prefixes (LayerSplit's broadcast)."""

    rows: torch.Tensor
    order: torch.Tensor | None
    logit_local: torch.Tensor
    logit_order: torch.Tensor | None
    seqs: list[SeqRows]
    prefix_pages: torch.Tensor

    @property
    def is_split(self) -> bool:
        return self.order is not None


def plan_split(step: StepBatch, page_size: int, rank: int, size: int) -> CPSplit:
    """Round-robin split of `step` over `size` ranks when it holds a prefill (a query of more than one token)."""
    device = step.input_ids.device
    n = step.num_tokens
    split = size > 1 and max(step.query_lens) > 1
    num_ranks, me = (size, rank) if split else (1, 0)
    per_rank = -(-n // num_ranks)
    rows = torch.arange(per_rank, device=device) * num_ranks + me
    rows[rows >= n] = 0                                                   # padding: row 0, dropped
    seqs, prefix = [], set()
    for s, (start, q_len, ctx) in enumerate(zip(step.query_starts, step.query_lens, step.context_lens_host)):
        # local rows j with start <= j * R + me < start + q_len
        first, end = -(-(start - me) // num_ranks), -(-(start + q_len - me) // num_ranks)
        pages = step.page_lists[s][:-(-ctx // page_size)]
        prefix.update(pages[:-(-(ctx - q_len) // page_size)])
        if end > first:
            local_t = torch.arange(first, end, device=device)
            seqs.append(SeqRows(local_t, step.positions[rows[local_t]],
                                torch.tensor(pages, dtype=torch.long, device=device), ctx))
    logit_rows = step.logit_rows.tolist()
    if not split:
        return CPSplit(rows, None, step.logit_rows, None, seqs,
                       torch.tensor(sorted(prefix), dtype=torch.long, device=device))
    g = torch.arange(n, device=device)
    order = (g % size) * per_rank + g // size
    counts = [sum(1 for r in logit_rows if r % size == k) for k in range(size)]
    per_rank_logits, seen = max(counts, default=0), [0] * size
    logit_order = []
    for r in logit_rows:
        logit_order.append((r % size) * per_rank_logits + seen[r % size])
        seen[r % size] += 1
    local_logits = [r // size for r in logit_rows if r % size == rank]
    local_logits += [0] * (per_rank_logits - len(local_logits))
    return CPSplit(rows, order, torch.tensor(local_logits, dtype=torch.long, device=device),
                   torch.tensor(logit_order, dtype=torch.long, device=device), seqs,
                   torch.tensor(sorted(prefix), dtype=torch.long, device=device))


class CPAttention:
    """The Attention protocol for one context-parallel step: q (M, H, D), k, v (M, KV, D) of this rank's rows ->
    (M, H * D); padding rows give zeros."""

    def __init__(self, kv: KVCache, step: StepBatch, split: CPSplit, comm: Communicator,
                 layer_split: LayerSplit | None):
        self.kv, self.step, self.split, self.comm, self.layer_split = kv, step, split, comm, layer_split

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, split, ls = self.kv, self.split, self.layer_split
        store, pending = layer_id, None
        if ls is not None:
            store, pending = ls.storage(layer_id), ls.post(kv, layer_id, split.prefix_pages)
        if split.is_split:
            num_kv = k.shape[1]
            local = k if kv.latent else torch.cat([k, v], dim=1)
            new = self.comm.all_gather(local, dim=0).index_select(0, split.order)
            k, v = (new, new) if kv.latent else (new[:, :num_kv], new[:, num_kv:])   # (N, KV, D) in step row order
            if ls is not None:
                ls.events.append((layer_id, "all_gather new kv"))
        if ls is not None:
            ls.wait(kv, pending)
            ls.events.append((layer_id, "attention"))
        kv.write(store, self.step.slot_mapping, k, v)
        out = torch.zeros_like(q)
        for seq in split.seqs:
            k_ctx, v_ctx = kv.read_pages(store, seq.page_ids)              # (KV, pages * page_size, D)
            for a in range(0, seq.local.numel(), QUERY_BLOCK):
                local, positions = seq.local[a:a + QUERY_BLOCK], seq.positions[a:a + QUERY_BLOCK]
                ctx = int(positions[-1]) + 1                                # keys past the block's last row: masked
                mask = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]   # (n, ctx) causal
                q_blk = q.index_select(0, local).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q_blk, k_ctx[:, :ctx].unsqueeze(0), v_ctx[:, :ctx].unsqueeze(0),
                                                   attn_mask=mask, enable_gqa=True)
                out.index_copy_(0, local, o.squeeze(0).transpose(0, 1))
        return out.view(q.shape[0], -1)


class CPModelRunner(ModelRunner):
    """A context-parallel rank's ModelRunner: whole weights, forward() split as above; with --enable-layer-split a
    KVCache of this rank's layers plus scratch (pages sized for ceil(L / R) + 1 layers, equal on every rank). MLA runs
    as MQA over its latent head (models/mla.py); raises ValueError for DSA models (the index keys' all-gather and
    LayerSplit's index-key broadcast are not built)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 checkpoint_kv_scales: dict[str, torch.Tensor] | None = None,
                 draft_model: torch.nn.Module | None = None, comm: Communicator | None = None):
        if model_config.dsa is not None:
            raise ValueError(f"--cp-size {config.cp_size}: DSA models ({model_config.architecture}) do not run under "
                             "context parallelism yet (MLA without the indexer does)")
        assert comm is not None and comm.size == config.cp_size, "a CP rank needs its group"
        self.comm = comm
        self.layer_split = LayerSplit(model_config.num_layers, comm) if config.enable_layer_split else None
        if self.layer_split is not None and config.max_total_tokens is None:
            layers = -(-model_config.num_layers // comm.size) + 1
            pages = num_pages(config, model_config, None, layers)
            config = dataclasses.replace(config, max_total_tokens=pages * config.page_size)
        super().__init__(model, model_config, config, checkpoint_kv_scales, draft_model)

    def kv_layers(self, model_config: ModelConfig) -> int:
        return model_config.num_layers if self.layer_split is None else self.layer_split.num_storage_layers

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[StepBatch, torch.Tensor]:
        step = build_step(batch, self.page_size, self.device)
        split = plan_split(step, self.page_size, self.comm.rank, self.comm.size)
        if self.layer_split is not None:
            self.layer_split.events.clear()
        attn = CPAttention(self.kv, step, split, self.comm, self.layer_split)
        logits = self.model(step.input_ids.index_select(0, split.rows), step.positions.index_select(0, split.rows),
                            attn, split.logit_local)
        if self.layer_split is not None:
            self.layer_split.finish(self.kv)
        if split.is_split and split.logit_local.numel():
            logits = self.comm.all_gather(logits, dim=0).index_select(0, split.logit_order)
        return step, logits

    def info(self) -> dict:
        return {**super().info(), "cp_size": self.comm.size, "layer_split": self.layer_split is not None}
