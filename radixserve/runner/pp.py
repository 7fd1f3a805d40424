"""Pipeline parallelism (--pp-size N): stage s holds consecutive decoder layers and only their KV; each step's
activations go point to point from stage to stage, cut into micro-batches so the stages overlap.

    layers:  stage s holds owned_layers(L, N, s) (layer_split.py); embedding on stage 0, final norm and LM head on N - 1
    ranks:   rank = stage * T + tp_rank (each stage a --tp-size T group); rank 0 also schedules, samples and
             broadcasts each step to every rank (runner/tp.py): page ids and count (for the largest stage) agree
    a step:  the batch cut into M micro-batches of consecutive sequences (sizes differ by at most one sequence)

        stage 0    embed+layers(m0) ─send─► embed+layers(m1) ─send─► ...          recv logits(m0 .. m M-1)
        stage 1             recv(m0) ─► layers(m0) ─send─► recv(m1) ─► layers(m1) ─send─► ...
        stage N-1                     recv(m0) ─► layers+norm+head(m0) ─send logits to 0─► recv(m1) ...

Sends are asynchronous (isend): stage s computes micro-batch m + 1 while s + 1 computes m; under TP, tp_rank i sends its
1/T of the residual's columns to the next stage's tp_rank i. Bytes, DSA, why M changes no row: docs/parallel.md."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from radixserve.config_checks import check_stages_fit
from radixserve.dist.comm import Communicator, Pending
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.layers.attention import SparseAttention
from radixserve.layers.parallel import Collectives
from radixserve.models.dsa import selection_rows
from radixserve.models.model_config import ModelConfig
from radixserve.runner.attention.base import create_backend
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_sizing import num_pages
from radixserve.runner.layer_split import owned_layers
from radixserve.runner.model_runner import ModelRunner


def split_micro_batches(batch: list[ScheduledSeq], num: int) -> list[list[ScheduledSeq]]:
    """`batch` cut into min(num, len(batch)) runs of consecutive sequences, the first len % parts one longer."""
    parts = min(num, len(batch))
    base, rem = divmod(len(batch), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < rem)
        out.append(batch[start:end])
        start = end
    return out


def stage_index_layers(mc: ModelConfig, layers: range) -> tuple[int, ...]:
    """The full DSA indexer layers among decoder `layers`, renumbered from layers.start = 0 (none without DSA)."""
    return () if mc.dsa is None else tuple(i - layers.start for i in mc.dsa.full_layers if i in layers)


class PPModelRunner(ModelRunner):
    """A stage's ModelRunner: its layers (and embedding / head) and their KVCache; forward() -> rank 0: the step's
    logits (R, V) fp32, the last stage: its rows, others: (0, V). ValueError: hidden size not divisible by --tp-size."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 checkpoint_kv_scales: dict[str, torch.Tensor] | None = None,
                 draft_model: torch.nn.Module | None = None, comm: Communicator | None = None):
        assert comm is not None and comm.size == config.pp_size * config.tp_size, "a pipeline stage needs its group"
        self.comm, self.tp_size = comm, config.tp_size
        self.stage, self.tp_rank = divmod(comm.rank, config.tp_size)
        self.layers = owned_layers(model_config.num_layers, config.pp_size, self.stage)
        self.is_first, self.is_last = self.stage == 0, self.stage == config.pp_size - 1
        self.num_micro_batches = config.pp_micro_batches or config.pp_size
        dsa = model_config.dsa
        self.receives_topk = dsa is not None and self.layers.start not in dsa.full_layers
        self.sends_topk = dsa is not None and not self.is_last and self.layers.stop not in dsa.full_layers
        if config.max_total_tokens is None:     # every stage the same pages: sized for the largest stage
            stages = [owned_layers(model_config.num_layers, config.pp_size, s) for s in range(config.pp_size)]
            heads = getattr(model, "num_kv_heads", None)
            pages = min(num_pages(config, model_config, heads, len(r), stage_index_layers(model_config, r))
                        for r in stages)
            config = dataclasses.replace(config, max_total_tokens=pages * config.page_size)
        super().__init__(model, model_config, config, checkpoint_kv_scales, draft_model)
        # no DecodeMirror (DSA has none): it keeps the slots of one decode group per step, each micro-batch another
        if dsa is None:
            self.backend = create_backend(config.attention_backend, self.kv, self.device,
                                          cascade=not config.disable_cascade_attention, mirror=False)

    @classmethod
    def select_part(cls, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    comm: Communicator | None = None, tp: Collectives | None = None,
                    **kwargs) -> Iterable[tuple[str, torch.Tensor]]:
        mc, tp_size = model.config, tp.size if tp is not None else 1
        stage, stages = comm.rank // tp_size, comm.size // tp_size
        check_stages_fit(stages, tp_size, mc.num_layers, mc.hidden_size)
        dropped = model.keep_stage(owned_layers(mc.num_layers, stages, stage), stage == 0, stage == stages - 1)
        return ((name, tensor) for name, tensor in weights if not name.startswith(dropped))

    def kv_layers(self, model_config: ModelConfig) -> int:
        return len(self.layers)

    def index_key_layers(self, full_layers: tuple[int, ...]) -> tuple[int, ...]:
        return stage_index_layers(self.model_config, self.layers)

    def _recv_selection(self, attn: SparseAttention) -> list[torch.Tensor | None] | None:
        """The previous stage's last DSA top-k for micro-batch `attn` (models/dsa.py selection_rows' shapes)."""
        topk = self.model_config.dsa.index_topk
        rows = selection_rows(attn.segments, topk)
        if rows is None:
            return None
        sizes = [n or 0 for n in rows]
        flat = self.comm.recv(torch.empty(sum(sizes), topk, dtype=torch.long, device=self.device),
                             self.comm.rank - self.tp_size)
        return [part if n is not None else None for part, n in zip(flat.split(sizes), rows)]

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[StepBatch, torch.Tensor]:
        step = build_step(batch, self.page_size, self.device)
        micro = split_micro_batches(batch, self.num_micro_batches)
        subs = [step] if len(micro) == 1 else [build_step(mb, self.page_size, self.device) for mb in micro]
        rank, width = self.comm.rank, self.model_config.hidden_size // self.tp_size
        sends: list[Pending] = []
        logits: list[torch.Tensor] = []
        for sub in subs:
            attn = self.backend.prepare(sub)
            if self.is_first:
                residual = self.model.embed(sub.input_ids)                     # (T_m, hidden)
            else:
                residual = self.comm.recv(torch.empty(sub.num_tokens, width, dtype=self.dtype, device=self.device),
                                          rank - self.tp_size)
                residual = residual if self.tp is None else self.tp.all_gather(residual, dim=-1)
                if self.receives_topk:
                    attn.shared_selection = self._recv_selection(attn)
            residual = self.model.run_layers(residual, sub.positions, attn, self.layers)
            if not self.is_last:
                part = residual.narrow(1, self.tp_rank * width, width)
                sends.append(self.comm.send_async(part, rank + self.tp_size))
                if self.sends_topk and attn.shared_selection is not None:
                    sends.append(self.comm.send_async(torch.cat([s for s in attn.shared_selection if s is not None]),
                                                      rank + self.tp_size))
                continue
            if sub.logit_rows.numel():
                logits.append(self.model.head(residual, sub.logit_rows))      # (R_m, V) fp32
                if self.tp_rank == 0:
                    sends.append(self.comm.send_async(logits[-1], 0))
        if rank == 0:
            last = self.comm.size - self.tp_size
            logits = [self.comm.recv(torch.empty(sub.logit_rows.numel(), self.vocab_size, device=self.device), last)
                      for sub in subs if sub.logit_rows.numel()]
        for pending in sends:
            pending.wait()
        if not logits:
            return step, torch.empty(0, self.vocab_size, device=self.device)
        return step, torch.cat(logits)

    def info(self) -> dict:
        return {**super().info(), "pp_size": self.config.pp_size, "pp_micro_batches": self.num_micro_batches,
                "pp_stage_layers": [self.layers.start, self.layers.stop]}
