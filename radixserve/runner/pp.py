"""Pipeline parallelism (--pp-size N): stage s holds consecutive decoder layers and only their KV; each step's
activations go point to point from stage to stage, cut into micro-batches so the stages overlap.

    layers:  stage s holds owned_layers(L, N, s): n_s = L // N + (s < L % N) layers from s * (L // N) + min(s, L % N)
             (the first L % N stages one more); the embedding on stage 0, the final norm and LM head on stage N - 1
    ranks:   rank = stage; rank 0 also schedules and samples, and broadcasts each step's batch to every stage
             (runner/tp.py), so the page ids (and the page count, sized for the stage of most KV bytes) agree
    a step:  the batch cut into M micro-batches of consecutive sequences (sizes differ by at most one sequence)

        stage 0    embed+layers(m0) ─send─► embed+layers(m1) ─send─► ...          recv logits(m0 .. m M-1)
        stage 1             recv(m0) ─► layers(m0) ─send─► recv(m1) ─► layers(m1) ─send─► ...
        stage N-1                     recv(m0) ─► layers+norm+head(m0) ─send logits to 0─► recv(m1) ...

Sends are asynchronous (isend), so stage s computes micro-batch m + 1 while stage s + 1 computes m. DSA: a stage
stores its full layers' index keys; one starting on an IndexShare layer also receives the top-k. Bytes moved and why M
does not change any row's arithmetic: docs/parallel.md."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from radixserve.dist.comm import Communicator, Pending
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.layers.attention import SparseAttention
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
    """A pipeline stage's ModelRunner: this stage's layers (and embedding / head) and a KVCache of its layers only;
    forward() as above. On rank 0 forward returns the whole step's logits (R, V) fp32 for run() to sample; on the
    last stage its own logit rows; on a middle stage (0, V)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 checkpoint_kv_scales: dict[str, torch.Tensor] | None = None,
                 draft_model: torch.nn.Module | None = None, comm: Communicator | None = None):
        assert comm is not None and comm.size == config.pp_size, "a pipeline stage needs its group"
        self.comm = comm
        self.layers = owned_layers(model_config.num_layers, comm.size, comm.rank)
        self.is_first, self.is_last = comm.rank == 0, comm.rank == comm.size - 1
        self.num_micro_batches = config.pp_micro_batches or config.pp_size
        dsa = model_config.dsa
        self.receives_topk = dsa is not None and self.layers.start not in dsa.full_layers
        self.sends_topk = dsa is not None and not self.is_last and self.layers.stop not in dsa.full_layers
        if config.max_total_tokens is None:     # every stage the same pages: sized for the largest stage
            stages = [owned_layers(model_config.num_layers, comm.size, s) for s in range(comm.size)]
            pages = min(num_pages(config, model_config, None, len(r), stage_index_layers(model_config, r))
                        for r in stages)
            config = dataclasses.replace(config, max_total_tokens=pages * config.page_size)
        super().__init__(model, model_config, config, checkpoint_kv_scales, draft_model)
        # no DecodeMirror (DSA has none): it keeps the slots of one decode group per step, each micro-batch another
        if dsa is None:
            self.backend = create_backend(config.attention_backend, self.kv, self.device,
                                          cascade=not config.disable_cascade_attention, mirror=False)

    @classmethod
    def select_part(cls, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    comm: Communicator | None = None, **kwargs) -> Iterable[tuple[str, torch.Tensor]]:
        mc = model.config
        if comm.size > mc.num_layers:
            raise ValueError(f"--pp-size {comm.size} exceeds the model's {mc.num_layers} layers")
        dropped = model.keep_stage(owned_layers(mc.num_layers, comm.size, comm.rank), comm.rank == 0,
                                   comm.rank == comm.size - 1)
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
        flat = self.comm.recv(torch.empty(sum(sizes), topk, dtype=torch.long, device=self.device), self.comm.rank - 1)
        return [part if n is not None else None for part, n in zip(flat.split(sizes), rows)]

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[StepBatch, torch.Tensor]:
        step = build_step(batch, self.page_size, self.device)
        micro = split_micro_batches(batch, self.num_micro_batches)
        subs = [step] if len(micro) == 1 else [build_step(mb, self.page_size, self.device) for mb in micro]
        rank, hidden = self.comm.rank, self.model_config.hidden_size
        sends: list[Pending] = []
        logits: list[torch.Tensor] = []
        for sub in subs:
            attn = self.backend.prepare(sub)
            if self.is_first:
                residual = self.model.embed(sub.input_ids)                     # (T_m, hidden)
            else:
                residual = self.comm.recv(torch.empty(sub.num_tokens, hidden, dtype=self.dtype, device=self.device),
                                          rank - 1)
                if self.receives_topk:
                    attn.shared_selection = self._recv_selection(attn)
            residual = self.model.run_layers(residual, sub.positions, attn, self.layers)
            if not self.is_last:
                sends.append(self.comm.send_async(residual, rank + 1))
                if self.sends_topk and attn.shared_selection is not None:
                    sends.append(self.comm.send_async(torch.cat([s for s in attn.shared_selection if s is not None]),
                                                      rank + 1))
                continue
            out = self.model.head(residual, sub.logit_rows)                    # (R_m, V) fp32
            logits.append(out)
            if not self.is_first and out.shape[0]:
                sends.append(self.comm.send_async(out, 0))
        if self.is_first and not self.is_last:
            logits = [self.comm.recv(torch.empty(sub.logit_rows.numel(), self.vocab_size, device=self.device),
                                     self.comm.size - 1) if sub.logit_rows.numel() else
                      torch.empty(0, self.vocab_size, device=self.device) for sub in subs]
        for pending in sends:
            pending.wait()
        if not logits:
            return step, torch.empty(0, self.vocab_size, device=self.device)
        return step, torch.cat(logits)

    def info(self) -> dict:
        return {**super().info(), "pp_size": self.comm.size, "pp_stage_layers": [self.layers.start, self.layers.stop],
                "pp_micro_batches": self.num_micro_batches}
