"""Sampling: penalties, min-tokens masking, temperature / min-p / top-k / top-p, seeded draws, and logprobs.

Order per row (vLLM v1 semantics): logprobs are taken from the RAW logits; then repetition
penalty (over prompt + output ids: positive logits divided, negative multiplied, as in
CTRL / HF), frequency and presence penalties (over output ids, OpenAI formula
`logit -= freq * count + pres * (count > 0)`), eos + stop ids masked while
`min_tokens_left > 0`; greedy rows take the argmax, other rows apply temperature, min-p,
top-k, top-p and draw one token by inverse CDF with a uniform from a torch.Generator seeded
by hash(seed, number of output ids) -- so a row's draw depends only on its own request,
never on what else is batched or on preemption.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


class SampleRow(Protocol):
    """What the sampler reads of one row (ScheduledSeq satisfies it)."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    min_tokens_left: int


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, sampling step): splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> list[TokenLogprob]:
    """Log-softmax of raw `logits` (R, V) fp32 at `token_ids` (R,) int64, plus the top_k
    most likely per row (top_k = 0: none)."""
    logprobs = torch.log_softmax(logits, dim=-1)             # (R, V); faster than logsumexp on CPU
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    ids = token_ids.tolist()
    if top_k <= 0:
        return [TokenLogprob(t, lp, []) for t, lp in zip(ids, chosen)]
    vals, idx = torch.topk(logprobs, min(top_k, logits.shape[1]), dim=-1)
    top_lp, top_ids = vals.tolist(), idx.tolist()
    return [TokenLogprob(t, lp, list(zip(ti, tl))) for t, lp, ti, tl in zip(ids, chosen, top_ids, top_lp)]


class Sampler:
    """Samples one token per row. `eos_token_ids` are masked (with each row's stop_token_ids)
    while a row's min_tokens_left > 0."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._generator = torch.Generator()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[TokenLogprob]:
        """logits: (R, V) fp32 raw model logits, one row per entry of `rows`. Returns one
        TokenLogprob per row; top lists hold `params.logprobs` entries (0 when None)."""
        assert logits.shape[0] == len(rows), "one logits row per sample row"
        x = self._penalised(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        drawn = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not drawn:
            tokens = x.argmax(dim=-1)
        elif not greedy:
            tokens = self._draw(x, rows)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
            tokens[greedy] = x[greedy].argmax(dim=-1)
            tokens[drawn] = self._draw(x[drawn], [rows[i] for i in drawn])
        k = max((r.params.logprobs or 0) for r in rows)
        out = token_logprobs(logits, tokens, k)
        return [TokenLogprob(s.token_id, s.logprob, s.top[:r.params.logprobs or 0]) for s, r in zip(out, rows)]

    # ---- logit processing ----------------------------------------------------------------
    def _penalised(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Penalties and the min-tokens mask; returns `logits` itself when nothing applies."""
        x = logits
        for i, r in enumerate(rows):
            p = r.params
            masked = r.min_tokens_left > 0 and (self.eos_token_ids or p.stop_token_ids)
            if not (p.has_penalties or masked):
                continue
            if x is logits:
                x = logits.clone()
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=x.device)
                vals = x[i, seen]
                x[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
                counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.long, device=x.device),
                                        minlength=self.vocab_size)[: self.vocab_size].to(x.dtype)
                x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
            if masked:
                ids = [t for t in set(self.eos_token_ids) | set(p.stop_token_ids) if 0 <= t < self.vocab_size]
                x[i, ids] = float("-inf")
        return x

    def _draw(self, x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """x: (n, V) penalised logits of non-greedy rows -> (n,) int64 sampled token ids."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
        x = x / temps[:, None]
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=x.dtype, device=x.device)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x, dim=-1)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(~keep, float("-inf"))
        top_k = [r.params.top_k if 0 < r.params.top_k < x.shape[1] else 0 for r in rows]
        if any(top_k):
            kth = torch.topk(x, max(top_k), dim=-1).values                      # (n, kmax)
            idx = torch.tensor([k - 1 if k else 0 for k in top_k], device=x.device)
            cut = kth.gather(1, idx[:, None])
            cut[torch.tensor(top_k, device=x.device) == 0] = float("-inf")
            x = x.masked_fill(x < cut, float("-inf"))                           # ties at the k-th stay
        top_p = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
        if top_p:
            top_p_values = torch.tensor([rows[i].params.top_p for i in top_p], dtype=x.dtype, device=x.device)
            x[top_p] = self._top_p(x[top_p], top_p_values)
        probs = torch.softmax(x, dim=-1)
        cdf = torch.cumsum(probs, dim=-1)                                      # (n, V)
        draws = []
        for r in rows:  # a CPU generator on every device: the same seed gives the same draw
            self._generator.manual_seed(step_seed(r.seed, len(r.output_ids)))
            draws.append(torch.rand((), generator=self._generator, dtype=torch.float64).item())
        u = torch.tensor(draws, dtype=x.dtype, device=x.device)[:, None]
        # First index whose cdf exceeds u * total: never a zero-probability (masked) token.
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return picked.clamp_(max=x.shape[1] - 1)

    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs                            # mass strictly above
        sorted_x = sorted_x.masked_fill(before >= top_p[:, None], float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)
