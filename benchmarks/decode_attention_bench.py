"""Decode attention per call: SDPA with the length mask (main's DecodeMirror call) vs radixserve::decode_attention.

`PYTHONPATH=. python benchmarks/decode_attention_bench.py [--threads 2] [--lens 64,320,1024,4096] [--batch-sizes 1,8]`
Shapes are the default model's (9 query heads, 3 KV heads, D 64); k and v are strided views of a mirror-shaped buffer;
the first sequence is 3 tokens short, so the mask is not all zeros. Prints microseconds per call (median of 7 runs)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.decode_mirror import decode_attention


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--lens", default="64,320,1024,4096")
    parser.add_argument("--batch-sizes", default="1,8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = decode_kernel.chosen_isa()
    print(f"threads {args.threads}, kernel path {isa}")
    for batch in map(int, args.batch_sizes.split(",")):
        for length in map(int, args.lens.split(",")):
            k_buf, v_buf = torch.randn(2, 3, batch + 8, length + 128, 64)
            k, v = k_buf[:, :batch, :length].transpose(0, 1), v_buf[:, :batch, :length].transpose(0, 1)
            q = torch.randn(batch, 9, 64)
            lens = torch.full((batch,), length)
            lens[0] = max(1, length - 3)
            visible = torch.arange(length)[None, :] < lens[:, None]
            mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None]
            calls = max(20, 200_000 // (batch * length))
            sdpa = per_call_us(lambda: decode_attention(q, k, v, mask), calls)
            line = f"B={batch} L={length}: sdpa {sdpa:.1f} us"
            if isa is not None:
                kernel = per_call_us(lambda: decode_kernel.decode_attention_lens(q, k, v, lens), calls)
                line += f", kernel {kernel:.1f} us ({sdpa / kernel:.1f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
