"""DraftModel: the draft model of `--speculative-algorithm draft` (the target's first L layers with its final norm and LM head, or a separate small model), with KV of its own.

Why its own KV: speculative acceptance doubles as a detector of corrupted target KV (a late
write into reused slots, a layer read before it was loaded): a draft that read the same KV
would be corrupted alike and keep agreeing. The draft's `KVCache` has L layers and the
target's page count and page size, indexed by the same page ids, so page tables and the page
budget are shared and only the storage is the draft's (L/N of the target's bytes).

Protocol, per step (ModelRunner.run):

    sync     after the target's forward, the draft runs over the same StepBatch (same token
             ids, positions and slots): its KV is written wherever and whenever the target's
             is (prefill chunks, decodes, verify positions, recomputes after preemption), so a
             page that holds target KV holds draft KV of the same tokens; the radix cache may
             share the page with any later request
    propose  for each sequence with ScheduledSeq.propose = k > 0 that sampled token t at
             position p: k greedy single-token steps from (t, p), writing draft KV at
             p .. p + k - 1 (pages the scheduler allocated ahead; the next step's sync and
             verify rewrite them); the k argmax tokens are the next step's draft

The draft never reads target KV, and nothing but this module writes the draft's KV (the
kv_corrupt fault, host-tier loads and transfers touch only the target's).
(Self-speculative decoding with an early-exit draft: Zhang et al. 2023 "Draft & Verify";
Elhoushi et al. 2024 "LayerSkip".)
"""
from __future__ import annotations

import dataclasses

import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_cache import KVCache


class DraftModel:
    """The first `num_layers` layers of `model` (a LlamaForCausalLM: the target itself for a
    self-draft, or a separate model with the target's vocabulary) as a draft model."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        """Raises ValueError when num_layers is not in [1, the model's layer count]."""
        mc = model.config
        if not 1 <= num_layers <= mc.num_layers:
            raise ValueError(f"speculative_draft_layers must be in [1, {mc.num_layers}], "
                             f"got {num_layers}")
        self.model, self.num_layers, self.page_size, self.device = model, num_layers, page_size, device
        self.kv = KVCache(num_layers, num_pages, page_size, mc.num_kv_heads, mc.head_dim, dtype, device)
        # The gather path: the DecodeMirror tracks decoding sequences step by step, and the
        # propose steps run ahead of them.
        self.backend = TorchAttentionBackend(self.kv, mirror_bytes=0)

    def _forward(self, step: StepBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, self.backend.prepare(step), logit_rows,
                          num_layers=self.num_layers)

    def sync(self, step: StepBatch) -> None:
        """Write the draft's KV for every token of the target's step (see module doc)."""
        self._forward(step, torch.empty(0, dtype=torch.long, device=self.device))

    def propose(self, seqs: list[ScheduledSeq], tokens: list[int], positions: list[int]) -> list[list[int]]:
        """Greedy drafts: for seqs[i] (propose = k_i), the k_i tokens that follow token
        tokens[i] placed at positions[i]."""
        drafts: list[list[int]] = [[] for _ in seqs]
        current = list(tokens)
        for i in range(max(s.propose for s in seqs)):
            live = [j for j, s in enumerate(seqs) if i < s.propose]
            batch = [dataclasses.replace(
                seqs[j], input_ids=[current[j]], start_pos=positions[j] + i, sample=True, draft=(),
                prompt_logprob_start=None) for j in live]
            step = build_step(batch, self.page_size, self.device)
            picked = self._forward(step, step.logit_rows).argmax(-1).tolist()
            for j, token in zip(live, picked):
                drafts[j].append(token)
                current[j] = token
        return drafts
