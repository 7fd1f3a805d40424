"""list[ScheduledSeq] -> one step's varlen tensors, built once on the runner's device. Sequence i owns token rows
[cu_seqlens_q[i], cu_seqlens_q[i+1]) and attends over positions [0, context_lens[i]) in pages page_table[i]."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.runner_api import ScheduledSeq


@dataclass(slots=True)
class StepBatch:
    """input_ids, positions, slot_mapping (T,) int64; cu_seqlens_q (B + 1,) int32; context_lens (B,) int32; page_table
    (B, max_pages) int32 padded with page 0; logit_rows (R,) int64. sample_rows[i] / prompt_rows[i] (first logit row,
    targets) index logit_rows' logits, None if unneeded; a k-token draft has k + 1 sample logits from sample_rows[i]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    page_table: torch.Tensor
    logit_rows: torch.Tensor
    request_ids: list[str]
    query_starts: list[int]
    query_lens: list[int]
    context_lens_host: list[int]
    page_lists: list[list[int]]
    sample_rows: list[int | None]
    prompt_rows: list[tuple[int, list[int]] | None]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prompt_logprob_targets(seq: ScheduledSeq) -> list[int]:
    """Prompt tokens at positions max(start, prompt_logprob_start) + 1 .. min(end, len(prompt) - 1) of this chunk."""
    first = max(seq.start_pos, seq.prompt_logprob_start or 0) + 1
    last = min(seq.start_pos + len(seq.input_ids), len(seq.prompt_ids) - 1)
    return seq.prompt_ids[first:last + 1]


def build_step(batch: list[ScheduledSeq], page_size: int, device: torch.device | str = "cpu") -> StepBatch:
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
        if seq.sample:
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
