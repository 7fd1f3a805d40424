"""Time an Engine's prefill-carrying steps and its decode-only steps on a burst of random prompts, to compare two checkouts or two flag sets.

    PYTHONPATH=. python benchmarks/prefill_steps.py [--quantization int4 --quantized-max-tokens 12]
    (cd ../other-checkout && PYTHONPATH=. python /path/to/benchmarks/prefill_steps.py)   # the other side

In one process with the default model (or --model-path): `--requests` prompts of `--prompt-len`
random tokens are added at once and run to `--max-tokens` greedy tokens each (`ignore_eos`),
the cache flushed between batches. Every `Engine.step()` is timed and counted as prefill-carrying
(some request was still prefilling when it started) or decode-only. One warm-up batch, then
`--batches` timed ones; prints the seconds of each kind per batch. Alternate the two sides'
runs yourself: the ratio of one run to the next says nothing on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

from radixserve.cli import build_runner
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams


def run_batch(engine: Engine, tag: str, args: argparse.Namespace, rng: random.Random) -> tuple[float, float]:
    """(seconds in prefill-carrying steps, seconds in decode-only steps) of one batch."""
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"{tag}-{i}", [rng.randrange(100, vocab) for _ in range(args.prompt_len)], params)
    prefill = decode = 0.0
    while engine.requests:
        prefilling = any(r.is_prefilling for r in engine.requests.values())
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if prefilling:
            prefill += elapsed
        else:
            decode += elapsed
    engine.flush_cache()
    return prefill, decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "auto"))
    ap.add_argument("--quantized-max-tokens", type=int, default=0)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args()
    config = EngineConfig(model_path=args.model_path, quantization=args.quantization,
                          quantized_max_tokens=args.quantized_max_tokens, max_running_requests=64)
    engine = Engine(config, build_runner(config))
    rng = random.Random(0)
    run_batch(engine, "warm-up", args, rng)
    times = [run_batch(engine, f"b{i}", args, rng) for i in range(args.batches)]
    print(f"{args.requests} x {args.prompt_len} tokens, quantization {args.quantization}"
          f"@{args.quantized_max_tokens}: prefill-carrying steps s {[round(p, 2) for p, _ in times]}, "
          f"decode-only steps s {[round(d, 2) for _, d in times]} (load {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
