"""MTPDraft: EAGLE-style drafting (`--speculative-algorithm EAGLE`, topk 1) with a NextN layer (models/nextn.py).

The draft's KV is layer N of the target's KVCache (N: its layer count): pages, radix cache, host tier and preemption
carry it. Draft KV at q comes from (h_q, x_{q+1}), the target's hidden state at q and the next token. After each step:

    step rows      q = s ........................ s+n-1
    known next     x_{s+1} .. x_{s+n-1}, then the sampled token (a verify step: accepted drafts + the token after them,
                   later rows dropped); a chunk sampling nothing carries h_{s+n-1} to the next (`_carry`, at q = s-1)
    draft chain    from the last row: draft 1 = argmax logits; draft j at position p+j-1 from (h'_{j-1}, draft j-1),
                   h' the layer's own output (written KV past p is rewritten next step)

Draft KV reused by a radix hit: docs/speculative.md."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from radixserve.engine.runner_api import ScheduledSeq, SeqResult
from radixserve.engine_config import EngineConfig
from radixserve.models.nextn import NextNLayer, prepare_nextn
from radixserve.runner.attention.sparse import SparseBackend
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.kv_cache import KVCache


@dataclass(slots=True)
class _Extend:
    seq: ScheduledSeq               # the draft step's sequence (input_ids: the next tokens)
    rows: torch.Tensor              # (n,) int64 rows of the target's hidden states, after `carried`
    carried: torch.Tensor | None    # (hidden_size,) h_{s-1} from the request's previous chunk
    index: int                      # position in the target batch
    propose: int                    # draft tokens wanted after it (0: extend only)


class MTPDraft:
    def __init__(self, layer: NextNLayer, kv: KVCache, page_size: int, device: torch.device,
                 max_carried: int, min_prob: float = 0.0):
        """`kv`: the target's KVCache with one more layer (index layer.self_attn.layer_id); `max_carried`: hidden
        states kept at chunk boundaries (one per request); `min_prob`: a chain ends before a draft below it."""
        assert kv.num_layers == layer.self_attn.layer_id + 1, "the draft's KV layer must be the last"
        self.layer, self.page_size, self.device = layer, page_size, device
        # No decode mirror: chain steps run ahead of the sequences a mirror tracks.
        self.backend = TorchAttentionBackend(kv, mirror_bytes=0)
        if getattr(layer.self_attn, "indexer", None) is not None:   # DSA: sparse over its own index keys
            self.backend = SparseBackend(self.backend)
        self.max_carried, self.min_prob = max_carried, min_prob
        self._carry: OrderedDict[str, tuple[int, torch.Tensor]] = OrderedDict()

    @classmethod
    def build(cls, config: EngineConfig, layer: NextNLayer | None, kv: KVCache, dtype: torch.dtype,
              device: torch.device) -> MTPDraft:
        """The draft of --speculative-algorithm EAGLE over `layer` as loaded (weights/nextn_loader.py), prepared."""
        if layer is None:
            raise ValueError("--speculative-algorithm EAGLE needs the checkpoint's NextN layer (from_config loads it)")
        prepare_nextn(layer, dtype, device, config.enable_deterministic_inference)
        return cls(layer.eval(), kv, config.page_size, device, max_carried=2 * config.max_running_requests,
                   min_prob=config.speculative_draft_min_prob or 0.0)

    def extend(self, batch: list[ScheduledSeq], step: StepBatch, hidden: torch.Tensor,
               results: list[SeqResult]) -> list[list[int]]:
        """Write draft KV for every row of the target's step (hidden (T, hidden_size) after the final norm) whose next
        token is known, then draft seqs[i].propose tokens after each sampled one; each sequence's drafts ([]: none)."""
        drafts: list[list[int]] = [[] for _ in batch]
        extends = [e for e in (self._plan(i, seq, step, hidden, res)
                               for i, (seq, res) in enumerate(zip(batch, results))) if e is not None]
        if not extends:
            return drafts
        parts = []
        for e in extends:
            if e.carried is not None:
                parts.append(e.carried.unsqueeze(0))
            parts.append(hidden.index_select(0, e.rows.to(hidden.device)))
        draft_step = build_step([e.seq for e in extends], self.page_size, self.device)
        out = self.layer.draft(draft_step.input_ids, torch.cat(parts), draft_step.positions,
                               self.backend.prepare(draft_step))
        wanting = [(j, e) for j, e in enumerate(extends) if e.propose > 0]
        if wanting:
            last = [draft_step.query_starts[j] + len(e.seq.input_ids) - 1 for j, e in wanting]
            self._chain([e for _, e in wanting], out[last], drafts)
        return drafts

    def _plan(self, i: int, seq: ScheduledSeq, step: StepBatch, hidden: torch.Tensor,
              res: SeqResult) -> _Extend | None:
        first, n, start = step.query_starts[i], step.query_lens[i], seq.start_pos
        old = self._carry.pop(seq.request_id, None)
        if seq.draft:
            n = len(res.token_ids)
            next_ids = list(res.token_ids)
        elif res.token_ids:
            next_ids = seq.input_ids[1:] + [res.token_ids[-1]]
        else:   # a prefill chunk: its last row waits for the next chunk's first token
            next_ids = seq.input_ids[1:]
            self._carry[seq.request_id] = (start + n - 1, hidden[first + n - 1].clone())
            while len(self._carry) > self.max_carried:
                self._carry.popitem(last=False)
            n -= 1
        carried = None
        if old is not None and old[0] == start - 1:   # else stale: the request was preempted or restarted
            next_ids, carried, start = [seq.input_ids[0], *next_ids], old[1], start - 1
        if not next_ids:
            return None
        propose = seq.propose if res.token_ids else 0
        draft_seq = ScheduledSeq(
            request_id=seq.request_id, input_ids=next_ids, start_pos=start, page_ids=seq.page_ids,
            sample=False, params=seq.params, seed=seq.seed, prompt_ids=seq.prompt_ids,
            output_ids=seq.output_ids, min_tokens_left=0, prompt_logprob_start=None)
        return _Extend(draft_seq, torch.arange(first, first + n), carried, i, propose)

    def _chain(self, wanting: list[_Extend], hidden: torch.Tensor, drafts: list[list[int]]) -> None:
        """Greedy chain from each extend's last row h' (hidden: (len(wanting), hidden_size)): draft 1 from its logits,
        draft j + 1 from the layer on (h'_j, draft j) at the last position + j; one below `min_prob` ends the chain."""
        while True:
            for e, token in zip(wanting, self.layer.propose(hidden, self.min_prob)):
                if token is None:
                    e.propose = len(drafts[e.index])
                else:
                    drafts[e.index].append(token)
            live = [k for k, e in enumerate(wanting) if len(drafts[e.index]) < e.propose]
            if not live:
                return
            wanting = [wanting[k] for k in live]
            seqs = [ScheduledSeq(
                request_id=e.seq.request_id, input_ids=[drafts[e.index][-1]],
                start_pos=e.seq.start_pos + len(e.seq.input_ids) - 1 + len(drafts[e.index]),
                page_ids=e.seq.page_ids, sample=False, params=e.seq.params, seed=e.seq.seed,
                prompt_ids=e.seq.prompt_ids, output_ids=e.seq.output_ids, min_tokens_left=0,
                prompt_logprob_start=None) for e in wanting]
            step = build_step(seqs, self.page_size, self.device)
            hidden = self.layer.draft(step.input_ids, hidden[live], step.positions, self.backend.prepare(step))
