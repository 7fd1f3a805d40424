"""A quantized model's LM head weights (layers/linear.py `enable_small_step_weights`) against the fp32 head, in one run.

    PYTHONPATH=. python benchmarks/lm_head.py [--rows 1,2,4,8,16,32] [--batches 1,4] [--quantization int4]

1. The default model's head alone (49152 x 576, random weights): median ms per call of the
   fp32 paths (split bmm at M = 1, oneDNN-packed above), FBGEMM's fp16-weight GEMM, the
   per-row int8 kernel and a oneDNN-packed bf16 copy (where this CPU has native bf16), for each
   number of logit rows M, alternated.
2. The engine (default model, `--quantization`, `--quantized-max-tokens 12`): decode steps of
   `--batches` running requests with the head this CPU gets (what `enable_small_step_weights`
   chose) and a plain fp32 head swapped in every 6 steps, median ms per step of each. The
   ratio is fp32 head time / chosen head time.
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
from radixserve.layers import batch_invariant as bi
from radixserve.layers.linear import Linear
from radixserve.layers.quant_linear import Int8Matmul, Int8Weight, kernel_available, native_bf16
from radixserve.sampling_params import SamplingParams


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def head_alone(rows: list[int], reps: int) -> None:
    fp32 = Linear(576, 49152)
    fp32.weight.data.normal_(0, 0.02)
    fp32.prepare()
    w = fp32.weight.data
    kernels = {"fp32": fp32}
    fp16 = torch.fbgemm_pack_gemm_matrix_fp16(w)
    zero = torch.zeros(49152)
    kernels["fp16"] = lambda x: torch.fbgemm_linear_fp16_weight(x, fp16, zero)
    if kernel_available(Int8Weight):
        kernels["int8"] = Int8Matmul([Int8Weight.from_float(w)])
    if native_bf16():
        bf16 = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 64)
        kernels["bf16"] = lambda x: bi.matmul(x.to(torch.bfloat16), bf16).float()
    print(f"\n## head alone, 49152 x 576, ms per call (load {os.getloadavg()[0]:.2f})\n")
    print("| rows | " + " | ".join(kernels) + " |\n|---:|" + "---:|" * len(kernels))
    for m in rows:
        x = torch.randn(m, 576)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(reps):
            for name, fn in kernels.items():
                times[name].append(median_ms(lambda: fn(x), 3))
        print(f"| {m} | " + " | ".join(f"{statistics.median(t):.2f}" for t in times.values()) + " |")


def engine_steps(quantization: str, batches: list[int], rounds: int) -> None:
    config = EngineConfig(quantization=quantization, quantized_max_tokens=12, max_running_requests=256)
    engine = Engine(config, build_runner(config))
    model = engine.runner.model
    chosen = model.lm_head
    if chosen._small is None:
        sys.exit(f"--quantization {quantization}: the head keeps fp32 (unquantized model or no kernel)")
    fp32 = Linear(576, chosen.out_features)
    fp32.weight = chosen.weight
    fp32.prepare()
    print(f"\n## engine decode steps, --quantization {quantization} --quantized-max-tokens 12\n")
    print("| batch | fp32 head ms/step | chosen head ms/step | fp32 / chosen | load |\n|---:|---:|---:|---:|---:|")
    for batch in batches:
        for i in range(batch):
            prompt = [(i * 7919 + j * 31) % 1000 + 10 for j in range(64)]
            engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(
                max_tokens=rounds * 14 + 32, temperature=0.0, ignore_eos=True))
        while len(engine.scheduler.running) < batch or any(r.is_prefilling for r in engine.requests.values()):
            engine.step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for use_chosen in (True, False):
                model.lm_head = chosen if use_chosen else fp32
                engine.step()                               # one untimed step after each switch
                for _ in range(6):
                    start = time.perf_counter()
                    engine.step()
                    times[use_chosen].append(time.perf_counter() - start)
        model.lm_head = chosen
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
