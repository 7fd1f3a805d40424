"""Sampling: penalties, min-tokens masking, temperature / min-p / top-k / top-p, seeded draws, and logprobs.

Per row (vLLM v1 order): logprobs of the RAW logits; logit_bias, repetition (CTRL / HF), frequency, presence (OpenAI)
penalties, EOS and stop ids masked while min_tokens_left > 0; argmax, or temperature, min-p, top-k, top-p and an
inverse-CDF draw seeded by (seed, output length) only: verify() samples as ordinary steps. A drawn token has p > 0."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import math

import torch

from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


class SampleRow(Protocol):
    request_id: str
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
    """Log-softmax of raw `logits` (R, V) fp32 at `token_ids` (R,) int64, with the top_k most likely per row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    best = logprobs.max(dim=-1).values.tolist()
    ids = token_ids.tolist()
    if top_k <= 0:
        return [TokenLogprob(t, lp, [], b) for t, lp, b in zip(ids, chosen, best)]
    vals, idx = torch.topk(logprobs, min(top_k, logits.shape[1]), dim=-1)
    top_lp, top_ids = vals.tolist(), idx.tolist()
    return [TokenLogprob(t, lp, list(zip(ti, tl)), b)
            for t, lp, ti, tl, b in zip(ids, chosen, top_ids, top_lp, best)]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._generator = torch.Generator()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               constrain: Callable[[torch.Tensor], None] | None = None) -> list[int]:
        """logits (R, V) fp32 raw -> one token id per row; `constrain` masks in place after the penalties."""
        return self._pick(logits, rows, constrain).tolist()

    def logprobs(self, logits: torch.Tensor, token_ids: Sequence[int],
                 rows: Sequence[SampleRow]) -> list[TokenLogprob] | None:
        """Raw logprobs of `token_ids` (one per row of `logits` (R, V) fp32), each row's top trimmed to its
        `params.logprobs`; None when no row asked for logprobs (`params.wants_logprobs`)."""
        if not any(r.params.wants_logprobs for r in rows):
            return None
        k = max((r.params.logprobs or 0) for r in rows)
        out = token_logprobs(logits, torch.tensor(list(token_ids), device=logits.device), k)
        return [TokenLogprob(s.token_id, s.logprob, s.top[:r.params.logprobs or 0], s.top_logprob)
                for s, r in zip(out, rows)]

    def _pick(self, logits: torch.Tensor, rows: Sequence[SampleRow],
              constrain: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """logits (R, V) fp32 raw -> (R,) int64 tokens: a function of the row's logits, params, seed and output length."""
        assert logits.shape[0] == len(rows), "one logits row per sample row"
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        drawn = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        tokens = self._plain_greedy(logits, rows) if not drawn and constrain is None else None
        if tokens is not None:
            return tokens
        x = self._masked(logits, rows, constrain)
        if not drawn:
            return x.argmax(dim=-1)
        if not greedy:
            return self._draw(x, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        tokens[greedy] = x[greedy].argmax(dim=-1)
        tokens[drawn] = self._draw(x[drawn], [rows[i] for i in drawn])
        return tokens

    def _plain_greedy(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor | None:
        """All-greedy argmax without a copy; None when a row needs processing (penalties, masks, a non-finite max)."""
        if any(r.params.adjusts_logits or self._min_tokens_masked(r) for r in rows):
            return None
        top, tokens = logits.max(dim=-1)
        return tokens if bool(torch.isfinite(top).all()) else None

    def _min_tokens_masked(self, r: SampleRow) -> bool:
        return r.min_tokens_left > 0 and bool(self.eos_token_ids or r.params.stop_token_ids)

    def _masked(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                constrain: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        x = finite_or_masked(self._penalised(logits, rows))
        if constrain is not None:
            constrain(x)
        return x

    def _penalised(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        x = logits
        for i, r in enumerate(rows):
            p = r.params
            masked = self._min_tokens_masked(r)
            if not (p.adjusts_logits or masked):
                continue
            if x is logits:
                x = logits.clone()
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=x.device)
                bias = torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device)
                x[i].index_add_(0, ids, bias)
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
        x = _processed(x, rows)
        probs = torch.softmax(x, dim=-1)
        cdf = torch.cumsum(probs, dim=-1)
        draws = []
        for r in rows:  # a CPU generator on every device: a seed draws alike anywhere
            self._generator.manual_seed(step_seed(r.seed, len(r.output_ids)))
            draws.append(torch.rand((), generator=self._generator, dtype=torch.float64).item())
        u = torch.tensor(draws, dtype=x.dtype, device=x.device)[:, None]
        # rounding can put u * total past the total: `degenerate` catches a zero-probability pick
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=x.shape[1] - 1)
        p_picked = probs.gather(1, picked)
        degenerate = ~(p_picked > 0) | ~torch.isfinite(x.gather(1, picked))
        picked = torch.where(degenerate, x.argmax(dim=-1, keepdim=True), picked)
        return picked.squeeze(1)

    def verify(self, logits: torch.Tensor, row: SampleRow,
               draft: Sequence[int]) -> tuple[list[int], list[TokenLogprob] | None]:
        """`logits` (k + 1, V) raw, row i the step after draft[:i] -> the tokens to emit (the accepted drafts, then the
        next token) and, if the row asked, their logprobs. Row i samples as the ordinary step at output position
        len(output_ids) + i would (its penalties, its (seed, position) draw); draft[i] is accepted iff it equals row i's
        token, so the tokens equal k + 1 ordinary steps', whatever the draft (docs/speculative.md, "Sampling")."""
        k = len(draft)
        picks = self._pick(logits, [_Shifted(row, list(draft[:i])) for i in range(k + 1)]).tolist()
        j = next((i for i in range(k) if picks[i] != draft[i]), k)
        ids = picks[:j + 1]
        if not row.params.wants_logprobs:
            return ids, None
        return ids, token_logprobs(logits[:j + 1], torch.tensor(ids, device=logits.device),
                                   max(row.params.logprobs or 0, 0))

    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep the smallest set of most likely tokens whose mass reaches top_p, and always the most likely."""
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= top_p[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)


@dataclass(slots=True)
class _Shifted:
    """A sample row as it will be `len(extra)` steps later, after `extra` was emitted."""

    row: SampleRow
    extra: list[int]

    @property
    def request_id(self) -> str:
        return self.row.request_id

    @property
    def params(self) -> SamplingParams:
        return self.row.params

    @property
    def seed(self) -> int:
        return self.row.seed

    @property
    def prompt_ids(self) -> list[int]:
        return self.row.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.row.output_ids + self.extra if self.extra else self.row.output_ids

    @property
    def min_tokens_left(self) -> int:
        return max(self.row.min_tokens_left - len(self.extra), 0)


def finite_or_masked(x: torch.Tensor) -> torch.Tensor:
    """A new tensor: NaN -> -inf (never drawn), +inf -> the dtype's largest finite value (x - max stays defined)."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))


def _processed(x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Finite or -inf (n, V) logits -> temperature, min-p, top-k, top-p applied, each row's max exactly 0 (no overflow)."""
    top = x.max(dim=-1, keepdim=True).values
    temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
    x = (x - top.masked_fill(torch.isinf(top), 0.0)) / temps[:, None]
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    min_p = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_p):
        # p_j >= min_p * p_max  <=>  x_j - x_max >= log(min_p), and x_max is 0 here.
        log_min_p = torch.tensor([math.log(p) if p > 0 else float("-inf") for p in min_p],
                                 dtype=x.dtype, device=x.device)
        x = x.masked_fill(x < log_min_p[:, None], float("-inf"))
    top_k = [r.params.top_k if 0 < r.params.top_k < x.shape[1] else 0 for r in rows]
    if any(top_k):
        kth = torch.topk(x, max(top_k), dim=-1).values
        idx = torch.tensor([k - 1 if k else 0 for k in top_k], device=x.device)
        cut = kth.gather(1, idx[:, None])
        cut[torch.tensor(top_k, device=x.device) == 0] = float("-inf")
        x = x.masked_fill(x < cut, float("-inf"))                               # ties at the k-th stay
    top_p = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if top_p:
        top_p_values = torch.tensor([rows[i].params.top_p for i in top_p], dtype=x.dtype, device=x.device)
        x[top_p] = Sampler._top_p(x[top_p], top_p_values)
    return x
