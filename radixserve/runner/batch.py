"""list[ScheduledSeq] -> one step's tensors in the varlen form attention kernels take, built once, on the runner's device.

Token rows of a step follow batch order; sequence i owns rows [cu_seqlens_q[i], cu_seqlens_q[i+1]):

    rows      | seq0 (decode) | seq1 (decode) | seq2 (prefill chunk ............) |
    positions | 37            | 5             | start_pos ... start_pos + n - 1   |
    context   | 38            | 6             | start_pos + n                     |

Sequence i attends causally over positions [0, context_lens[i]), whose KV lives in the pages
page_table[i, :ceil(context_lens[i] / page_size)]. Backends derive anything else (masks,
groups) from this in their own `prepare`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.runner_api import ScheduledSeq


@dataclass(slots=True)
class StepBatch:
    """All tensors of one step. Device tensors for kernels, host lists for Python-side planning.

    `sample_rows[i]` / `prompt_rows[i]` index into the logits computed for `logit_rows`
    (None when sequence i needs none); a sequence with a draft of k tokens has k + 1 sample
    logits from sample_rows[i] on."""

    input_ids: torch.Tensor          # (T,) int64
    positions: torch.Tensor          # (T,) int64
    slot_mapping: torch.Tensor       # (T,) int64, where each token's KV is written
    cu_seqlens_q: torch.Tensor       # (B + 1,) int32, token-row offsets of each sequence
    context_lens: torch.Tensor       # (B,) int32, start_pos + query length
    page_table: torch.Tensor         # (B, max_pages) int32, padded with page 0
    logit_rows: torch.Tensor         # (R,) int64 token rows whose logits are computed
    # host copies of the per-sequence metadata
    request_ids: list[str]
    query_starts: list[int]          # first token row of each sequence
    query_lens: list[int]
    context_lens_host: list[int]
    page_lists: list[list[int]]      # pages covering [0, context_lens_host[i])
    sample_rows: list[int | None]
    prompt_rows: list[tuple[int, list[int]] | None]   # (first logit row, target ids)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prompt_logprob_targets(seq: ScheduledSeq) -> list[int]:
    """Prompt tokens whose logprob this chunk yields: positions max(start, prompt_logprob_start)+1
    .. min(end, len(prompt)-1), each predicted from the position before it (the last one may be
    the next chunk's first token, read from prompt_ids)."""
    first = max(seq.start_pos, seq.prompt_logprob_start or 0) + 1
    last = min(seq.start_pos + len(seq.input_ids), len(seq.prompt_ids) - 1)
    return seq.prompt_ids[first:last + 1]


def build_step(batch: list[ScheduledSeq], page_size: int, device: torch.device | str = "cpu") -> StepBatch:
    """Turn the scheduler's batch into step tensors (see module docstring)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    contexts: list[int] = []
    page_lists: list[list[int]] = []
    logit_rows: list[int] = []
    sample_rows: list[int | None] = []
    prompt_rows: list[tuple[int, list[int]] | None] = []
    for seq in batch:
        row, n, start = len(ids), len(seq.input_ids), seq.start_pos
        end = start + n
        num_pages = -(-end // page_size)
        assert n > 0 and len(seq.page_ids) >= num_pages, f"{seq.request_id}: page table too short"
        pages = seq.page_ids
        ids.extend(seq.input_ids)
        positions.extend(range(start, end))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
        starts.append(row)
        lens.append(n)
        contexts.append(end)
        page_lists.append(pages[:num_pages])
        if seq.prompt_logprob_start is not None:
            targets = prompt_logprob_targets(seq)
            first = max(start, seq.prompt_logprob_start) - start
            prompt_rows.append((len(logit_rows), targets))
            logit_rows.extend(range(row + first, row + first + len(targets)))
        else:
            prompt_rows.append(None)
        sample_rows.append(len(logit_rows) if seq.sample else None)
        if seq.sample:   # a draft is verified from the logits of all its positions
            logit_rows.extend(range(row + n - 1 - len(seq.draft), row + n))
    max_pages = max(len(p) for p in page_lists)
    table = [p + [0] * (max_pages - len(p)) for p in page_lists]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepBatch(
        input_ids=tensor(ids, torch.long), positions=tensor(positions, torch.long),
        slot_mapping=tensor(slots, torch.long), cu_seqlens_q=tensor(starts + [len(ids)], torch.int32),
        context_lens=tensor(contexts, torch.int32), page_table=tensor(table, torch.int32),
        logit_rows=tensor(logit_rows, torch.long), request_ids=[s.request_id for s in batch],
        query_starts=starts, query_lens=lens, context_lens_host=contexts, page_lists=page_lists,
        sample_rows=sample_rows, prompt_rows=prompt_rows)
