"""Batch-1 decode TPOT against context length, eager and compiled, with decode attention's share of each step.

    PYTHONPATH=. python benchmarks/context_decode.py [--lens 64,300,600,1200] [--tokens 32] [--rounds 2]
        [--compile on,off] [--model PATH]

The engines run the defaults (--quantization auto, fp32 KV) but for --compile. For each context length and round
(engines alternating, ABBA) one greedy request of a random prompt of that length decodes --tokens tokens. Printed
per length and engine: TPOT (median ms per decode step), the decode attention kernel's ms per step (all layers; the
module functions decode_mirror.decode_attention_lens and decode_kernel.decode_attention_paged wrapped with a
timer), the attention backend's `prepare` ms per
step, the fp32 KV bytes the kernel reads per step with the rate that implies, and the first decode step's ms (TPOT
includes it, as a serving benchmark's does)."""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.attention import decode_kernel, decode_mirror
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams


class Timers:
    """Seconds spent in the wrapped functions, summed since `reset`."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sums[name] += time.perf_counter() - start
        return timed


def decode(engine: Engine, prompt: list[int], tokens: int, timers: Timers) -> tuple[float, dict[str, float]]:
    """ms per decode step of one greedy request (its first token's prefill excluded) and per-step ms of each timer,
    "first" the first decode step's ms."""
    engine.add_request(f"r{random.random()}", prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                                     ignore_eos=True))
    out: list[int] = []
    step_ms: list[float] = []
    first = None
    while engine.has_unfinished():
        start = time.perf_counter()
        for o in engine.step():
            out.extend(o.new_token_ids)
        if first is not None:
            step_ms.append(1000 * (time.perf_counter() - start))
        if first is None and out:
            first = time.perf_counter()
            timers.sums.clear()
    steps = len(out) - 1
    return 1000 * (time.perf_counter() - first) / steps, {"first": step_ms[0],
                                                          **{k: 1000 * v / steps for k, v in timers.sums.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lens", default="64,300,600,1200")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", default="on,off")
    args = ap.parse_args()
    timers = Timers()
    decode_mirror.decode_attention_lens = timers.wrap("attention", decode_mirror.decode_attention_lens)
    if hasattr(decode_kernel, "decode_attention_paged"):   # absent before the paged kernel (run on older trees)
        decode_kernel.decode_attention_paged = timers.wrap("attention", decode_kernel.decode_attention_paged)
    engines = {}
    for mode in args.compile.split(","):
        config = EngineConfig(model_path=args.model, compile=mode)
        engines[mode] = Engine(config, ModelRunner.from_config(config))
        backend = engines[mode].runner.backend
        backend.prepare = timers.wrap("prepare", backend.prepare)
    kv = next(iter(engines.values())).runner.kv
    token_bytes = kv.token_bytes
    rng = random.Random(0)
    for engine in engines.values():   # warm-up
        decode(engine, [rng.randrange(100, 30000) for _ in range(64)], 8, timers)
    print(f"load {os.getloadavg()[0]:.2f} at start; KV {token_bytes / 1024:.0f} KiB per token ({kv.dtype})")
    print(f"{'ctx':>5} {'engine':>6} {'TPOT ms':>8} {'attn ms':>8} {'prep ms':>8} {'KV MB':>6} {'attn GB/s':>9} {'1st ms':>7}  rounds")
    for length in map(int, args.lens.split(",")):
        results: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
        for r in range(args.rounds):
            order = list(engines.items())
            for mode, engine in (order if r % 2 == 0 else order[::-1]):
                prompt = [rng.randrange(100, 30000) for _ in range(length)]
                results[mode].append(decode(engine, prompt, args.tokens, timers))
        kv_mb = token_bytes * (length + args.tokens / 2) / 1e6   # mean context over the decode steps
        for mode, runs in results.items():
            tpot = statistics.median(t for t, _ in runs)
            attn = statistics.median(p.get("attention", 0.0) for _, p in runs)
            prep = statistics.median(p.get("prepare", 0.0) for _, p in runs)
            first = statistics.median(p["first"] for _, p in runs)
            rate = kv_mb / attn if attn else 0.0
            print(f"{length:>5} {mode:>6} {tpot:>8.2f} {attn:>8.2f} {prep:>8.2f} {kv_mb:>6.1f} {rate:>9.1f} {first:>7.2f}  "
                  + ", ".join(f"{t:.2f}" for t, _ in runs), flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
