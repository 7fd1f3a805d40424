"""The torch backend's per-step metadata: the decode group and prefill chunks with their additive masks, built from a StepBatch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.runner.batch import StepBatch


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences: rows (B,) int64 (row_slice if contiguous); page_table (B * max_pages,) int64 padded with
    page 0; mask (B, 1, 1, max_pages * page_size) additive; lens: context lengths incl. the new token."""

    rows: torch.Tensor
    row_slice: tuple[int, int] | None
    page_table: torch.Tensor
    mask: torch.Tensor
    max_pages: int
    request_ids: list[str]
    page_lists: list[list[int]]
    lens: list[int]


@dataclass(slots=True)
class PrefillSeq:
    """Rows [row_start, row_end) at start_pos..; after a cached prefix, `page_ids` under `mask` (1, 1, n, context_len)."""

    row_start: int
    row_end: int
    start_pos: int
    context_len: int
    page_ids: torch.Tensor | None
    mask: torch.Tensor | None


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool `visible` -> additive mask in `dtype` (SDPA would convert a bool mask every layer)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def split_step(step: StepBatch, page_size: int, dtype: torch.dtype) -> tuple[DecodeGroup | None, list[PrefillSeq]]:
    device = step.input_ids.device
    decode: list[int] = []
    prefills: list[PrefillSeq] = []
    for i, (row, n, context) in enumerate(zip(step.query_starts, step.query_lens, step.context_lens_host)):
        if n == 1:
            decode.append(i)
        else:
            prefills.append(_prefill(row, n, context, step.page_lists[i], dtype, device))
    group = _decode(step, decode, page_size, dtype, device) if decode else None
    return group, prefills


def _prefill(row: int, n: int, context: int, pages: list[int], dtype: torch.dtype,
             device: torch.device) -> PrefillSeq:
    start = context - n
    if start == 0:
        return PrefillSeq(row, row + n, 0, n, None, None)
    q_pos = torch.arange(start, context, device=device)[:, None]
    visible = (torch.arange(context, device=device)[None, :] <= q_pos)[None, None]
    return PrefillSeq(row, row + n, start, context, torch.tensor(pages, dtype=torch.long, device=device),
                      additive_mask(visible, dtype))


def _decode(step: StepBatch, members: list[int], page_size: int, dtype: torch.dtype,
            device: torch.device) -> DecodeGroup:
    rows = [step.query_starts[i] for i in members]
    pages = [step.page_lists[i] for i in members]
    lens = [step.context_lens_host[i] for i in members]
    max_pages = max(len(p) for p in pages)
    if len(members) == len(step.query_lens):
        page_table, lens_t = step.page_table.long().view(-1), step.context_lens.long()
    else:
        table = [p + [0] * (max_pages - len(p)) for p in pages]
        page_table = torch.tensor(table, dtype=torch.long, device=device).view(-1)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    visible = torch.arange(max_pages * page_size, device=device)[None, :] < lens_t[:, None]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeGroup(rows=torch.tensor(rows, dtype=torch.long, device=device),
                       row_slice=(rows[0], rows[0] + len(rows)) if contiguous else None,
                       page_table=page_table,
                       mask=additive_mask(visible, dtype)[:, None, None, :], max_pages=max_pages,
                       request_ids=[step.request_ids[i] for i in members], page_lists=pages, lens=lens)
