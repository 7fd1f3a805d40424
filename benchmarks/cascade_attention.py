"""Cascade decode attention on vs off: decode steps of requests behind shared prefixes, same process, ratio.

    PYTHONPATH=. python benchmarks/cascade_attention.py [--batch 32] [--groups 4] [--prefix-len 768]
        [--own-len 64] [--steps 8] [--rounds 4]

Two engines on the default model (fp32), one with `--disable-cascade-attention`, each holding
`--batch` decoding requests: `--groups` system prompts of `--prefix-len` tokens, each request
adding `--own-len` tokens of its own (so the radix cache gives each group the same prefix
pages). Rounds alternate the engines (AB BA ...), `--steps` decode steps each; prints the median
ms per decode step of each side, the off / on ratio, the load average, and whether the greedy
tokens of both sides agree.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from radixserve.cli import build_runner
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams


def engine_with_requests(cascade: bool, args: argparse.Namespace) -> Engine:
    """An engine whose `--batch` requests have been prefilled and are decoding."""
    config = EngineConfig(max_running_requests=max(args.batch, 1), disable_cascade_attention=not cascade)
    engine = Engine(config, build_runner(config))
    budget = args.steps * args.rounds + 8
    for i in range(args.batch):
        group = i % args.groups
        prompt = ([(group * 7919 + j * 31) % 1000 + 10 for j in range(args.prefix_len)]
                  + [(i * 104729 + j * 37) % 1000 + 10 for j in range(args.own_len)])
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=budget, temperature=0.0,
                                                           ignore_eos=True))
    while any(r.is_prefilling for r in engine.requests.values()):
        engine.step()
    for _ in range(2):   # warm the decode path
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--own-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    engines = {True: engine_with_requests(True, args), False: engine_with_requests(False, args)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(args.rounds):
        for cascade in ((True, False) if rnd % 2 == 0 else (False, True)):
            for _ in range(args.steps):
                start = time.perf_counter()
                outs = engines[cascade].step()
                times[cascade].append(time.perf_counter() - start)
                assert len(outs) == args.batch, "a request finished or stalled while timed"
    tokens = {c: {rid: r.output_ids for rid, r in e.requests.items()} for c, e in engines.items()}
    on, off = (1000 * statistics.median(times[c]) for c in (True, False))
    print(f"load {os.getloadavg()[0]:.2f}; batch {args.batch}, {args.groups} groups sharing "
          f"{args.prefix_len} tokens + {args.own_len} own; {args.rounds} rounds x {args.steps} steps")
    print(f"ms per decode step: cascade {on:.1f}, plain {off:.1f}; plain / cascade {off / on:.2f}x; "
          f"greedy tokens equal: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
