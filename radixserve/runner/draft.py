"""DraftModel: the draft of `--speculative-algorithm draft` (the target's first L layers, or a small model) with its own KV.

Its own KV (L layers, the target's page ids) makes corrupted target KV show as disagreement (Draft & Verify; LayerSkip)."""
from __future__ import annotations

import dataclasses

import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.runner.attention.sparse import SparseBackend, add_index_keys
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_cache import KVCache


class DraftModel:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        """Raises ValueError when num_layers is not in [1, the model's layer count]."""
        mc = model.config
        if not 1 <= num_layers <= mc.num_layers:
            raise ValueError(f"speculative_draft_layers must be in [1, {mc.num_layers}], "
                             f"got {num_layers}")
        self.model, self.num_layers, self.page_size, self.device = model, num_layers, page_size, device
        heads, head_dim, latent = mc.kv_shape
        self.kv = KVCache(num_layers, num_pages, page_size, heads, head_dim, dtype, device, latent=latent)
        # No decode mirror: propose steps run ahead of the sequences a mirror tracks.
        self.backend = TorchAttentionBackend(self.kv, mirror_bytes=0)
        dsa = getattr(mc, "dsa", None)
        if dsa is not None:   # DSA: the draft's full indexer layers keep their own index keys (bf16/fp32, never FP8)
            add_index_keys(self.kv, tuple(i for i in dsa.full_layers if i < num_layers), dsa.index_head_dim, dtype)
            self.backend = SparseBackend(self.backend)

    def _forward(self, step: StepBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, self.backend.prepare(step), logit_rows,
                          num_layers=self.num_layers)

    def sync(self, step: StepBatch) -> None:
        self._forward(step, torch.empty(0, dtype=torch.long, device=self.device))

    def propose(self, seqs: list[ScheduledSeq], tokens: list[int], positions: list[int]) -> list[list[int]]:
        """Greedy drafts: the seqs[i].propose tokens after tokens[i] at positions[i] (writes their draft KV)."""
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
