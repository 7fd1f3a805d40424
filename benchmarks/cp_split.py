"""Round-robin against zigzag and contiguous token splits for CP prefill: each rank's causal attention time.

    PYTHONPATH=. python benchmarks/cp_split.py [--tokens 4096,8192] [--ranks 2,4] [--repeats 3]

One prompt of N tokens, heads H x D (GQA folded into H, fp32), no cached prefix. Each rank attends its own query
rows over every key at or before them, the way runner/cp.py's CPAttention does: query rows in blocks of
QUERY_BLOCK, each block one SDPA over the keys up to its last row with a position mask. The splits:
  round-robin  row g -> rank g % R (what radixserve runs)
  zigzag       2R equal chunks, rank r gets chunks r and 2R-1-r (SGLang's, for one sequence)
  contiguous   R equal chunks, rank r gets chunk r
A CP step waits for its slowest rank, so the table gives each split's slowest rank and the ratio slowest / fastest.
All ranks run in this one process in turn (torch threads as set), alternated per repeat; the minimum is kept."""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from radixserve.runner.cp import QUERY_BLOCK


def split_rows(n: int, ranks: int, kind: str) -> list[torch.Tensor]:
    """Each rank's global query rows (ascending) under `kind`."""
    if kind == "round-robin":
        return [torch.arange(r, n, ranks) for r in range(ranks)]
    chunks = torch.arange(n).chunk(2 * ranks if kind == "zigzag" else ranks)
    if kind == "contiguous":
        return list(chunks)
    return [torch.cat([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)]


def rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                   block_rows: int = QUERY_BLOCK) -> torch.Tensor:
    """q, k, v (H, N, D); rows (M,) ascending positions -> (H, M, D): row i attends keys 0 .. rows[i]."""
    out = []
    for block in rows.split(block_rows):
        last = int(block[-1]) + 1
        mask = torch.arange(last)[None, :] <= block[:, None]            # (m, last) bool
        out.append(F.scaled_dot_product_attention(q[:, block], k[:, :last], v[:, :last], attn_mask=mask))
    return torch.cat(out, dim=1)


def time_ranks(q, k, v, splits: list[torch.Tensor], block_rows: int) -> list[float]:
    times = []
    for rows in splits:
        start = time.perf_counter()
        rank_attention(q, k, v, rows, block_rows)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--query-blocks", default=str(QUERY_BLOCK), help="query rows per SDPA, one table row each")
    args = ap.parse_args()
    kinds = [(kind, b) for kind in ("round-robin", "zigzag", "contiguous")
             for b in map(int, args.query_blocks.split(","))]
    print(f"threads {torch.get_num_threads()}, heads {args.heads} x {args.head_dim}, fp32, QUERY_BLOCK {QUERY_BLOCK}")
    print("| tokens | ranks | split | rows per SDPA | slowest rank ms | slowest / fastest |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n in map(int, args.tokens.split(",")):
        q, k, v = (torch.randn(args.heads, n, args.head_dim, generator=gen) for _ in range(3))
        for ranks in map(int, args.ranks.split(",")):
            splits = {kind: split_rows(n, ranks, kind[0]) for kind in kinds}
            full = rank_attention(q, k, v, torch.arange(n))
            for kind, rows in splits.items():    # every split computes the same rows as one rank would
                got = torch.cat([rank_attention(q, k, v, r) for r in rows], dim=1)[:, torch.cat(rows).argsort()]
                assert torch.allclose(got, full, atol=1e-5), kind
            best = {kind: [float("inf")] * ranks for kind in kinds}
            for _ in range(args.repeats):
                for kind in kinds:
                    times = time_ranks(q, k, v, splits[kind], kind[1])
                    best[kind] = [min(a, b) for a, b in zip(best[kind], times)]
            for kind in kinds:
                t = best[kind]
                print(f"| {n} | {ranks} | {kind[0]} | {kind[1]} | {max(t) * 1e3:.1f} | {max(t) / min(t):.2f} |")


if __name__ == "__main__":
    main()
