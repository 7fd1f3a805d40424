"""Single-stream decode TPOT, eager vs --compile on, side by side in one process, and start-up time with compile.

Run:  python benchmarks/compiled_decode.py [--quantization none|int4] [--tokens 64] [--rounds 4]

Both engines serve the default model (or --model); each round times one greedy request of --tokens new tokens on
each, alternating which goes first (ABBA), after one warm-up request each. Prints ms per output token (decode
steps only: the first token's prefill is excluded), the start-up time of each engine (the compiled one: cold when
its cache key is new, else loaded from $RADIXSERVE_CACHE_DIR), the memory each added, and that the greedy tokens
agree."""
from __future__ import annotations

import argparse
import random
import statistics
import time

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def build(args, compile_mode: str) -> tuple[Engine, float]:
    """The engine and its start-up seconds; prints the resident memory it added."""
    start, before = time.perf_counter(), rss_mb()
    config = EngineConfig(model_path=args.model, quantization=args.quantization, compile=compile_mode,
                          torch_compile_max_bs=args.max_bs)
    engine = Engine(config, ModelRunner.from_config(config))
    print(f"{compile_mode:3s}: the engine added {rss_mb() - before:.0f} MB resident")
    return engine, time.perf_counter() - start


def tpot_ms(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """ms per decode step of one greedy request, and its tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rid = f"r{random.random()}"
    engine.add_request(rid, prompt, params)
    out: list[int] = []
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if first is None and out:
            first = time.perf_counter()
    return 1000 * (time.perf_counter() - first) / (len(out) - 1), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-bs", type=int, default=8)
    args = ap.parse_args()
    compiled, compiled_s = build(args, "on")
    assert compiled.runner.decode_graphs is not None, "compile failed (see the log)"
    eager, eager_s = build(args, "off")
    print(f"start-up: eager {eager_s:.1f} s, compiled {compiled_s:.1f} s "
          f"({compiled.runner.decode_graphs.info()['cache']})")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(32)]
    results: dict[str, list[float]] = {"eager": [], "compiled": []}
    tokens = {}
    for name, engine in (("eager", eager), ("compiled", compiled)):
        tokens[name] = tpot_ms(engine, prompt, args.tokens)[1]   # warm-up
    for r in range(args.rounds):
        order = [("eager", eager), ("compiled", compiled)]
        for name, engine in (order if r % 2 == 0 else order[::-1]):
            results[name].append(tpot_ms(engine, [rng.randrange(100, 30000) for _ in range(32)], args.tokens)[0])
    for name, values in results.items():
        print(f"{name:9s} TPOT ms: median {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
    ratio = statistics.median(results["eager"]) / statistics.median(results["compiled"])
    print(f"compiled speed-up: {ratio:.2f}x; greedy tokens equal: {tokens['eager'] == tokens['compiled']}; "
          f"recompiles: {compiled.runner.decode_graphs.recompiles}")


if __name__ == "__main__":
    main()
