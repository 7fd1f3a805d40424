"""ScheduledBatch -> the tensors of one step (ids, positions, slot mapping, attention groups, logit rows), built once.

Token rows of a step follow `batch.seqs` order; sequence i owns rows [row_start, row_end):

    rows      | seq0 (decode) | seq1 (decode) | seq2 (prefill chunk ............) |
    positions | 37            | 5             | start_pos ... start_pos + n - 1   |

Sequences with one input token form the *decode group*: one padded page-table gather and one
SDPA per layer for all of them. Longer sequences (prefill chunks) each attend to their
cached prefix plus themselves, causally.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.engine.runner_api import ScheduledBatch, ScheduledSeq


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences attended together.

    rows: (B,) int64 token rows; `row_slice` is set instead when they are rows [a, b).
    page_table: (B * max_pages,) int64, each sequence's pages padded with page 0.
    mask: (B, 1, 1, max_pages * page_size) additive, 0 for key positions < seq length, -inf after.
    """

    rows: torch.Tensor
    row_slice: tuple[int, int] | None
    page_table: torch.Tensor
    mask: torch.Tensor
    max_pages: int
    request_ids: list[str]           # per sequence, for backends that keep state across steps
    page_lists: list[list[int]]      # page ids covering [0, lens[i])
    lens: list[int]                  # context length including the new token


@dataclass(slots=True)
class PrefillSeq:
    """One multi-token chunk: rows [row_start, row_end) at positions start_pos.., context_len
    = start_pos + n. With a cached prefix (start_pos > 0) attention gathers `page_ids` and
    uses the additive `mask` (1, 1, n, context_len): 0 where key j <= start_pos + i, else -inf."""

    row_start: int
    row_end: int
    start_pos: int
    context_len: int
    page_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class StepBatch:
    """All tensors of one step. `sample_rows[i]` / `prompt_rows[i]` index into the logits
    computed for `logit_rows` (None when sequence i needs none)."""

    input_ids: torch.Tensor          # (T,) int64
    positions: torch.Tensor          # (T,) int64
    slot_mapping: torch.Tensor       # (T,) int64, where each token's KV is written
    decode: DecodeGroup | None
    prefills: list[PrefillSeq]
    logit_rows: torch.Tensor         # (R,) int64 token rows whose logits are computed
    sample_rows: list[int | None] = field(default_factory=list)
    prompt_rows: list[tuple[int, list[int]] | None] = field(default_factory=list)  # (first logit row, target ids)


def prompt_logprob_targets(seq: ScheduledSeq) -> list[int]:
    """Prompt tokens whose logprob this chunk yields: positions max(start, prompt_logprob_start)+1
    .. min(end, len(prompt)-1), each predicted from the position before it (the last one may be
    the next chunk's first token, read from prompt_ids)."""
    first = max(seq.start_pos, seq.prompt_logprob_start or 0) + 1
    last = min(seq.start_pos + len(seq.input_ids), len(seq.prompt_ids) - 1)
    return seq.prompt_ids[first:last + 1]


def build_step(batch: ScheduledBatch, page_size: int, dtype: torch.dtype = torch.float32) -> StepBatch:
    """Turn the scheduler's batch into step tensors (see module docstring); attention masks
    are additive in `dtype` (SDPA would otherwise convert a bool mask in every layer)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_ids: list[str] = []
    decode_pages: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    logit_rows: list[int] = []
    sample_rows: list[int | None] = []
    prompt_rows: list[tuple[int, list[int]] | None] = []
    for seq in batch.seqs:
        row, n, start = len(ids), len(seq.input_ids), seq.start_pos
        end = start + n
        num_pages = -(-end // page_size)
        assert n > 0 and len(seq.page_ids) >= num_pages, f"{seq.request_id}: page table too short"
        pages = seq.page_ids
        ids.extend(seq.input_ids)
        positions.extend(range(start, end))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
        if n == 1:
            decode_rows.append(row)
            decode_ids.append(seq.request_id)
            decode_pages.append(pages[:num_pages])
            decode_lens.append(end)
        else:
            prefills.append(_prefill(row, start, n, pages[:num_pages], dtype))
        if seq.prompt_logprob_start is not None:
            targets = prompt_logprob_targets(seq)
            first = max(start, seq.prompt_logprob_start) - start
            prompt_rows.append((len(logit_rows), targets))
            logit_rows.extend(range(row + first, row + first + len(targets)))
        else:
            prompt_rows.append(None)
        sample_rows.append(len(logit_rows) if seq.sample else None)
        if seq.sample:
            logit_rows.append(row + n - 1)
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        decode=_decode(decode_rows, decode_ids, decode_pages, decode_lens, page_size, dtype) if decode_rows else None,
        prefills=prefills, logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        sample_rows=sample_rows, prompt_rows=prompt_rows)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def _prefill(row: int, start: int, n: int, pages: list[int], dtype: torch.dtype) -> PrefillSeq:
    if start == 0:  # nothing cached: plain causal attention over the chunk's own k, v
        return PrefillSeq(row, row + n, 0, n, None, None)
    context = start + n
    q_pos = torch.arange(start, context)[:, None]
    visible = (torch.arange(context)[None, :] <= q_pos)[None, None]         # (1, 1, n, context)
    return PrefillSeq(row, row + n, start, context, torch.tensor(pages, dtype=torch.long),
                      _additive(visible, dtype))


def _decode(rows: list[int], request_ids: list[str], pages: list[list[int]], lens: list[int],
            page_size: int, dtype: torch.dtype) -> DecodeGroup:
    max_pages = max(len(p) for p in pages)
    table = [p + [0] * (max_pages - len(p)) for p in pages]
    lens_t = torch.tensor(lens, dtype=torch.long)
    visible = torch.arange(max_pages * page_size)[None, :] < lens_t[:, None]  # (B, max_len)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeGroup(rows=torch.tensor(rows, dtype=torch.long),
                       row_slice=(rows[0], rows[0] + len(rows)) if contiguous else None,
                       page_table=torch.tensor(table, dtype=torch.long).view(-1),
                       mask=_additive(visible, dtype)[:, None, None, :], max_pages=max_pages,
                       request_ids=request_ids, page_lists=pages, lens=lens)
