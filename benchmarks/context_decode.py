"""Batch-1 decode TPOT against context length, eager and compiled, with decode attention's share of each step.

    PYTHONPATH=. python benchmarks/context_decode.py [--lens 64,300,600,1200] [--tokens 32] [--rounds 2]
        [--compile on,off] [--kv-cache-dtypes auto,bfloat16] [--mirror] [--calls] [--model PATH]

The engines run the defaults (--quantization auto, fp32 KV) but for --compile. For each context length and round
(engines alternating, ABBA) one greedy request of a random prompt of that length decodes --tokens tokens. Printed
per length and engine: TPOT (median ms per decode step), the decode attention kernel's ms per step (all layers; the
module functions decode_mirror.decode_attention_lens and decode_kernel.decode_attention_paged wrapped with a
timer), the attention backend's `prepare` ms per
step (`--mirror`: also engines named MODE-m whose lone decodes go through the DecodeMirror instead of reading the
pages in place), the fp32 KV bytes the kernel reads per step with the rate that implies, and the first decode step's ms (TPOT
includes it, as a serving benchmark's does). `--calls` instead times one captured step's attention alone (prepare
and the per-layer calls, paged vs mirror, alternated in one process; see attention_calls)."""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict

import torch

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.attention import decode_kernel, decode_mirror
from radixserve.runner.batch import build_step
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


@torch.inference_mode()
def attention_calls(engine: Engine, length: int, rng: random.Random, reps: int = 20) -> dict[str, list[float]]:
    """One batch-1 decode step at context `length`, captured, then its attention (prepare, and one call per layer
    on random q, k, v) timed in place, read in place ("paged") and through the mirror ("mirror") alternately.
    ms per step: each mode's per-step medians of 2 alternations, prepare including a mirror fill each time."""
    runner = engine.runner
    rid = f"calls{length}"
    engine.add_request(rid, [rng.randrange(100, 30000) for _ in range(length)],
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    batches, forward = [], runner.forward
    runner.forward = lambda batch: batches.append(batch) or forward(batch)
    for _ in range(3):
        engine.step()
    runner.forward = forward
    engine.abort(rid)
    step = build_step(batches[-1], runner.page_size, runner.device)
    kv, backend = runner.kv, runner.backend
    heads = runner.model_config.num_heads
    q, (k, v) = torch.randn(1, heads, kv.head_dim), torch.randn(2, 1, kv.num_kv_heads, kv.head_dim)
    times: dict[str, list[float]] = defaultdict(list)
    for paged in (True, False, True, False):
        name = "paged" if paged else "mirror"
        backend.reads_pages = paged
        start = time.perf_counter()
        attn = backend.prepare(step)
        times[f"{name} prepare"].append(1000 * (time.perf_counter() - start))
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            for layer in range(kv.num_layers):
                attn(layer, q, k, v)
            runs.append(1000 * (time.perf_counter() - start))
        times[name].append(statistics.median(runs))
    backend.reads_pages = True
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lens", default="64,300,600,1200")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", default="on,off")
    ap.add_argument("--mirror", action="store_true", help="also each --compile mode with paged reads off (-m)")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="engines for each: auto (fp32), bfloat16 (-bflo)")
    ap.add_argument("--calls", action="store_true", help="only time one step's attention calls, paged vs mirror")
    args = ap.parse_args()
    timers = Timers()
    decode_mirror.decode_attention_lens = timers.wrap("attention", decode_mirror.decode_attention_lens)
    if hasattr(decode_kernel, "decode_attention_paged"):   # absent before the paged kernel (run on older trees)
        decode_kernel.decode_attention_paged = timers.wrap("attention", decode_kernel.decode_attention_paged)
    engines = {}
    kv_dtypes = args.kv_cache_dtypes.split(",")
    names = [(mode + ("" if dtype == "auto" else f"-{dtype[:4]}"), mode, dtype, paged)
             for paged in ((True, False) if args.mirror else (True,)) for dtype in kv_dtypes
             for mode in args.compile.split(",")]
    names = [(name + ("" if paged else "-m"), mode, dtype, paged) for name, mode, dtype, paged in names]
    for name, mode, dtype, paged in names:
        config = EngineConfig(model_path=args.model, compile=mode, kv_cache_dtype=dtype)
        engines[name] = Engine(config, ModelRunner.from_config(config))
        backend = engines[name].runner.backend
        backend.reads_pages = paged and getattr(backend, "reads_pages", False)
        backend.prepare = timers.wrap("prepare", backend.prepare)
    kv = next(iter(engines.values())).runner.kv
    token_bytes = kv.token_bytes
    rng = random.Random(0)
    lens = [int(n) for n in args.lens.split(",")]
    for engine in engines.values():   # warm-up at the longest context: buffers sized as in a serving steady state
        decode(engine, [rng.randrange(100, 30000) for _ in range(max(lens))], 8, timers)
    print(f"load {os.getloadavg()[0]:.2f} at start; KV {token_bytes / 1024:.0f} KiB per token ({kv.dtype}, the first "
          f"engine's)")
    if args.calls:
        for length in lens:
            times = attention_calls(next(iter(engines.values())), length, rng)
            print(f"ctx {length}: " + ", ".join(f"{name} {min(ms):.3f}" for name, ms in times.items())
                  + " ms per step (best of 2)", flush=True)
        print(f"load {os.getloadavg()[0]:.2f} at end")
        return
    print(f"{'ctx':>5} {'engine':>9} {'TPOT ms':>8} {'attn ms':>8} {'prep ms':>8} {'KV MB':>6} {'attn GB/s':>9} {'1st ms':>7}  rounds")
    for length in lens:
        results: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
        for r in range(args.rounds):
            order = list(engines.items())
            for mode, engine in (order if r % 2 == 0 else order[::-1]):
                prompt = [rng.randrange(100, 30000) for _ in range(length)]
                results[mode].append(decode(engine, prompt, args.tokens, timers))
        for mode, runs in results.items():
            # stored KV at the mean context over the decode steps (a mirror reads it as fp32)
            kv_mb = engines[mode].runner.kv.token_bytes * (length + args.tokens / 2) / 1e6
            tpot = statistics.median(t for t, _ in runs)
            attn = statistics.median(p.get("attention", 0.0) for _, p in runs)
            prep = statistics.median(p.get("prepare", 0.0) for _, p in runs)
            first = statistics.median(p["first"] for _, p in runs)
            rate = kv_mb / attn if attn else 0.0
            print(f"{length:>5} {mode:>9} {tpot:>8.2f} {attn:>8.2f} {prep:>8.2f} {kv_mb:>6.1f} {rate:>9.1f} {first:>7.2f}  "
                  + ", ".join(f"{t:.2f}" for t, _ in runs), flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
