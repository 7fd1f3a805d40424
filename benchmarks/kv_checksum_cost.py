"""Cost of --enable-kv-checksum: the same offline workload through an engine with KV checksums and one without, one run, ratio printed.

    PYTHONPATH=. python benchmarks/kv_checksum_cost.py [--batches 1,32] [--prompt-len 256]
        [--output-len 64] [--interval 16] [--rounds 2]

Two `LLM`s on the embedded default model (fp32, radix cache off so every round computes the
same), one with --enable-kv-checksum at --interval. Per batch size, each round generates the
same random prompts greedily (ignore_eos) on both, in ABBA order so drift on a shared machine
hits both alike. Prints the median output tok/s per side, checked / plain, the slots each
checksum pass summed, and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from radixserve import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Output tokens per second of one generate() over `prompts`."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    common = {"disable_radix_cache": True, "max_total_tokens": 65536}
    sides = {"plain": LLM(**common),
             "checked": LLM(**common, enable_kv_checksum=True, kv_checksum_interval=args.interval)}
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    vocab = sides["plain"].engine.runner.vocab_size
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        for llm in sides.values():
            timed(llm, prompts[:1], SamplingParams(max_tokens=2))   # warm-up
        speeds: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name in ("plain", "checked", "checked", "plain"):
                speeds[name].append(timed(sides[name], prompts, params))
        plain, checked = (statistics.median(speeds[n]) for n in ("plain", "checked"))
        print(f"batch {batch:3d}: plain {plain:7.2f} tok/s, checked {checked:7.2f} tok/s, "
              f"checked / plain {checked / plain:.3f}  (runs: {speeds})")
    sums = sides["checked"].engine.checksums
    print(f"slots summed: {sums.num_checked_slots}, mismatches: {sums.num_mismatched_slots}; "
          f"interval {args.interval}; load avg 1m {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
