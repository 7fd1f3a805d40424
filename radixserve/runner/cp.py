"""Context-parallel prefill (--cp-size R): every rank holds the whole model and runs 1/R of a prefill step's tokens.

    rows:       step row g < N (build_step's order) -> rank g % R, local row g // R; M = ceil(N / R) rows (pad: row 0)
    per layer:  k|v (M, 2KV, D) ──all_gather──► (R*M) ──order──► (N): every rank writes ALL new KV at the step's slots,
                then attends its own queries over each whole context; MLA (V = K) gathers k (M, 1, r + rope) only
    end:        each rank's logit rows (padded to K) ──all_gather──► the step's logit rows, in order

A decode step runs unsplit on every rank (every cache stays whole). Attention is computed here, not by the runner's
backends, which assume one contiguous query block per sequence (why round-robin, the DSA order: docs/parallel.md)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.dist.comm import Communicator
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.layers.attention import Segment
from radixserve.models.model_config import ModelConfig
from radixserve.runner import kv_transfer
from radixserve.runner.attention.sparse import INDEX_KEYS, attend_chosen, read_index_keys, write_index_keys
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.kv_sizing import index_key_layers, num_pages
from radixserve.runner.layer_split import LayerSplit, PendingKV, page_slots
from radixserve.runner.model_runner import ModelRunner

# CPAttention's query rows per SDPA: a block reads keys up to its last row only, about the causal half of rows x ctx
QUERY_BLOCK = 128


@dataclass(frozen=True, slots=True)
class SeqRows:
    """One sequence's rows on this rank: local (n,) int64 row indices (consecutive; n may be 0), positions (n,) int64,
    its context's page ids (pages,) int64 and context length in tokens."""

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
    """Attention for one CP step: q (M, H, D), k, v (M, KV, D) of this rank's rows -> (M, H * D); padding rows: 0."""

    def __init__(self, kv: KVCache, step: StepBatch, split: CPSplit, comm: Communicator,
                 layer_split: LayerSplit | None):
        self.kv, self.step, self.split, self.comm, self.layer_split = kv, step, split, comm, layer_split
        self._pending: dict[int, PendingKV] = {}

    def storage(self, layer_id: int) -> int:
        """The KVCache layer holding model layer `layer_id` on this rank (LayerSplit: its own or the scratch)."""
        return layer_id if self.layer_split is None else self.layer_split.storage(layer_id)

    def post_kv(self, layer_id: int) -> None:
        """LayerSplit: start layer `layer_id`'s KV broadcast, once per layer (DSA: before its indexer, to overlap)."""
        if self.layer_split is not None and layer_id not in self._pending:
            self._pending[layer_id] = self.layer_split.post(self.kv, layer_id, self.split.prefix_pages)

    def store_new_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """k, v (M, KV, D), all-gathered if split, written at the step's slots after wait(KV) -> the storage layer."""
        kv, split, ls = self.kv, self.split, self.layer_split
        self.post_kv(layer_id)
        store = self.storage(layer_id)
        if split.is_split:
            num_kv = k.shape[1]
            local = k if kv.latent else torch.cat([k, v], dim=1)
            new = self.comm.all_gather(local, dim=0).index_select(0, split.order)
            k, v = (new, new) if kv.latent else (new[:, :num_kv], new[:, num_kv:])   # (N, KV, D) in step row order
            if ls is not None:
                ls.events.append((layer_id, "all_gather new kv"))
        if ls is not None:
            ls.wait(kv, self._pending.pop(layer_id))
            ls.events.append((layer_id, "attention"))
        kv.write(store, self.step.slot_mapping, k, v)
        return store

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = self.store_new_kv(layer_id, k, v)
        out = torch.zeros_like(q)
        for seq in self.split.seqs:
            if not seq.local.numel():
                continue
            k_ctx, v_ctx = self.kv.read_pages(store, seq.page_ids)              # (KV, pages * page_size, D)
            for a in range(0, seq.local.numel(), QUERY_BLOCK):
                local, positions = seq.local[a:a + QUERY_BLOCK], seq.positions[a:a + QUERY_BLOCK]
                ctx = int(positions[-1]) + 1                                # keys past the block's last row: masked
                mask = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]   # (n, ctx) causal
                q_blk = q.index_select(0, local).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q_blk, k_ctx[:, :ctx].unsqueeze(0), v_ctx[:, :ctx].unsqueeze(0),
                                                   attn_mask=mask, enable_gqa=True)
                out.index_copy_(0, local, o.squeeze(0).transpose(0, 1))
        return out.view(q.shape[0], -1)


def segment(seq: SeqRows, stride: int) -> Segment:
    """`seq`'s rows on this rank as a Segment (row j at position positions[0] + stride * j); empty: rows [0, 0)."""
    if not seq.local.numel():
        return Segment(0, 0, 0, seq.context_len, stride)
    return Segment(int(seq.local[0]), int(seq.local[-1]) + 1, int(seq.positions[0]), seq.context_len, stride)


class CPSparseAttention(CPAttention):
    """SparseAttention for a CP step of a DSA model: a Segment per sequence over this rank's rows (stride R if split;
    maybe none: every rank takes the same path). Per full layer under LayerSplit: broadcast index_k -> all_gather new
    index_k -> wait index_k -> broadcast kv -> indexer -> all_gather new kv -> wait kv -> attention."""

    def __init__(self, kv: KVCache, step: StepBatch, split: CPSplit, comm: Communicator,
                 layer_split: LayerSplit | None):
        super().__init__(kv, step, split, comm, layer_split)
        stride = comm.size if split.is_split else 1
        self.segments = [segment(s, stride) for s in split.seqs]
        self.shared_selection: list[torch.Tensor | None] | None = None
        self._slots = [page_slots(kv, s.page_ids)[:s.context_len] for s in split.seqs]

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        """keys (M, Di) of this rank's rows: every new token's key stored (all-gathered on a split step), after the
        owner's broadcast of the cached prefix's keys under LayerSplit; then layer_id's KV broadcast starts."""
        kv, split, ls = self.kv, self.split, self.layer_split
        pending = ls.post(kv, layer_id, split.prefix_pages, side=INDEX_KEYS) if ls is not None else None
        if split.is_split:
            keys = self.comm.all_gather(keys, dim=0).index_select(0, split.order)          # (N, Di) step row order
            if ls is not None:
                ls.events.append((layer_id, f"all_gather new {INDEX_KEYS}"))
        if ls is not None:
            ls.wait(kv, pending)
        write_index_keys(kv, self.storage(layer_id), self.step.slot_mapping, keys)
        self.post_kv(layer_id)
        if ls is not None:
            ls.events.append((layer_id, "indexer"))

    def index_keys(self, layer_id: int, seq: int) -> torch.Tensor:
        return read_index_keys(self.kv, self.storage(layer_id), self._slots[seq])

    def attend_selected(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                        selected: list[torch.Tensor | None]) -> torch.Tensor:
        store = self.store_new_kv(layer_id, k, k)
        out = torch.zeros_like(q)
        for i, (seg, seq, chosen) in enumerate(zip(self.segments, self.split.seqs, selected)):
            if seg.row_end > seg.row_start:
                rows = slice(seg.row_start, seg.row_end)
                out[rows] = attend_chosen(self.kv, store, q[rows], self._slots[i], chosen, seq.positions)
        return out.view(q.shape[0], -1)


class CPModelRunner(ModelRunner):
    """A CP rank's ModelRunner: whole weights, forward() split as above; with --enable-layer-split a KVCache of this
    rank's layers plus scratch, pages sized for ceil(L / R) + 1 layers (equal on every rank)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 checkpoint_kv_scales: dict[str, torch.Tensor] | None = None,
                 draft_model: torch.nn.Module | None = None, comm: Communicator | None = None):
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

    def index_key_layers(self, full_layers: tuple[int, ...]) -> tuple[int, ...]:
        if self.layer_split is None:
            return full_layers
        return tuple(sorted({self.layer_split.storage(layer) for layer in full_layers}))

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[StepBatch, torch.Tensor]:
        step = build_step(batch, self.page_size, self.device)
        split = plan_split(step, self.page_size, self.comm.rank, self.comm.size)
        if self.layer_split is not None:
            self.layer_split.events.clear()
        attention = CPSparseAttention if self.model.config.dsa is not None else CPAttention
        attn = attention(self.kv, step, split, self.comm, self.layer_split)
        logits = self.model(step.input_ids.index_select(0, split.rows), step.positions.index_select(0, split.rows),
                            attn, split.logit_local)
        if self.layer_split is not None:
            self.layer_split.finish(self.kv)
        if split.is_split and split.logit_local.numel():
            logits = self.comm.all_gather(logits, dim=0).index_select(0, split.logit_order)
        return step, logits

    def kv_layout(self) -> dict:
        """ModelRunner.kv_layout; under LayerSplit export_kv's bytes hold every model layer, not this rank's storage."""
        layers = self.model_config.num_layers
        return {**super().kv_layout(), **({} if self.layer_split is None else
                                           {"num_layers": layers, "layer_ids": tuple(range(layers))})}

    @property
    def export_gathers(self) -> bool:
        return self.layer_split is not None

    def export_kv(self, page_ids: list[int]) -> bytes:
        """Under LayerSplit every rank runs it (followers on KVExport): rank 0 returns all layers, a follower b""."""
        if self.layer_split is None:
            return super().export_kv(page_ids)
        side = {name: index_key_layers(self.model_config) for name in self.kv.side_names}
        pages = self.layer_split.gather_pages(self.kv, page_ids, side)
        return b"" if pages is None else kv_transfer.pack_pages(pages)

    def info(self) -> dict:
        return {**super().info(), "cp_size": self.comm.size, "layer_split": self.layer_split is not None}
