"""The LM head's fp16-weight path (layers/linear.py `enable_fp16_weight`) against its fp32 paths, in one run.

    PYTHONPATH=. python benchmarks/lm_head.py [--rows 1,2,4,8,16,32] [--batches 1,4] [--quantization int4]

1. The default model's head alone (49152 x 576, random weights): median ms per call of the
   fp32 paths (split bmm at M = 1, oneDNN-packed above) and of FBGEMM's fp16-weight GEMM, for
   each number of logit rows M, alternating the two.
2. The engine (default model, `--quantization`, `--quantized-max-tokens 12`): decode steps of
   `--batches` running requests with the fp16 head switched on and off every 6 steps, median
   ms per step of each. The ratio is fp32 head time / fp16 head time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from radixserve.cli import build_runner
from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.layers.linear import Linear
from radixserve.sampling_params import SamplingParams


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def head_alone(rows: list[int], reps: int) -> None:
    fp32, fp16 = Linear(576, 49152), Linear(576, 49152)
    fp32.weight.data.normal_(0, 0.02)
    fp16.weight = fp32.weight
    fp32.prepare()
    fp16.prepare()
    if not fp16.enable_fp16_weight(max(rows)):
        sys.exit("no FBGEMM fp16-weight GEMM in this torch build")
    print(f"\n## head alone, 49152 x 576 (load {os.getloadavg()[0]:.2f})\n")
    print("| rows | fp32 ms | fp16 weights ms | fp32 / fp16 |\n|---:|---:|---:|---:|")
    for m in rows:
        x = torch.randn(m, 576)
        a, b = [], []
        for _ in range(reps):
            a.append(median_ms(lambda: fp32(x), 3))
            b.append(median_ms(lambda: fp16(x), 3))
        a_ms, b_ms = statistics.median(a), statistics.median(b)
        print(f"| {m} | {a_ms:.2f} | {b_ms:.2f} | {a_ms / b_ms:.2f}x |")


def engine_steps(quantization: str, batches: list[int], rounds: int) -> None:
    config = EngineConfig(quantization=quantization, quantized_max_tokens=12, max_running_requests=256)
    engine = Engine(config, build_runner(config))
    head = engine.runner.model.lm_head
    packed = head._fp16
    if packed is None:
        sys.exit(f"--quantization {quantization}: the head has no fp16 path (only quantized models)")
    print(f"\n## engine decode steps, --quantization {quantization} --quantized-max-tokens 12\n")
    print("| batch | fp32 head ms/step | fp16 head ms/step | fp32 / fp16 | load |\n|---:|---:|---:|---:|---:|")
    for batch in batches:
        for i in range(batch):
            prompt = [(i * 7919 + j * 31) % 1000 + 10 for j in range(64)]
            engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(
                max_tokens=rounds * 14 + 32, temperature=0.0, ignore_eos=True))
        while len(engine.scheduler.running) < batch or any(r.is_prefilling for r in engine.requests.values()):
            engine.step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for fp16 in (True, False):
                head._fp16 = packed if fp16 else None
                engine.step()                               # one untimed step after each switch
                for _ in range(6):
                    start = time.perf_counter()
                    engine.step()
                    times[fp16].append(time.perf_counter() - start)
        head._fp16 = packed
        for rid in list(engine.requests):
            engine.abort(rid)
        on, off = (1000 * statistics.median(times[k]) for k in (True, False))
        print(f"| {batch} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {os.getloadavg()[0]:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--quantization", default="int4", choices=("int4", "int8", "auto"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    head_alone([int(r) for r in args.rows.split(",")], args.reps)
    engine_steps(args.quantization, [int(b) for b in args.batches.split(",")], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
