"""Weight-only quantized linear layers on the default model: speed and quality of int4 / int8 against fp32, in one run.

Run:  python benchmarks/quantized.py [--modes none,int4,int8,int4@12] [--batches 1,16,64] [--reps 3] [--kernels]
                                    [--llama-cpp]

A mode `int4@N` is int4 with --quantized-max-tokens N (steps of more than N tokens on the float
copy: bf16 where the CPU multiplies bf16 natively, else fp32). A suffix `/fp32` loads the mode as
a CPU without native bf16 would (`native_bf16` patched to False while loading): fp32 copies.

Speed (greedy, ignore_eos, 16-token random prompts, runs interleaved mode by mode so load
drift hits all alike; median of --reps): batch-1 decode ms/token = (time for 1 + T tokens -
time for 1 token) / T; batch-N throughput = output tokens / wall time of N requests of
--out-tokens each (prefill included). Ratios are against fp32 (`none`) measured in this run.
Quality, on the parity prompts (tests/model/parity.py) as chat turns: each prompt's fp32
greedy continuation (--quality-tokens) is teacher-forced through each mode with
prompt_logprobs=1; greedy agreement = the mode's top-1 equals the fp32 token, mean |Δ logprob|
of the fp32 token; plus the first position where free-running greedy output leaves fp32's.
`--llama-cpp` scores llama.cpp on the same GGUF the same way (benchmarks/peers/llama_cpp_logits.py).
Also: linear-layer weight bytes and (cached) load time. `uptime` load is printed with each table.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from radixserve import LLM, SamplingParams
from radixserve.layers import linear
from radixserve.layers.linear import Linear
from tests.model.parity import PARITY_TEXTS


def load() -> str:
    return "load avg " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(llm: LLM, prompts: list[list[int]], out_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    llm.engine.flush_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def speed(llms: dict[str, LLM], batches: list[int], out_tokens: int, reps: int) -> None:
    rng = random.Random(0)
    vocab = next(iter(llms.values())).engine.runner.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(max(batches))]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        for name, llm in llms.items():
            for batch in batches:
                if batch == 1:
                    one, _ = timed(llm, prompts[:1], 1)
                    full, _ = timed(llm, prompts[:1], 1 + out_tokens)
                    value = 1000 * (full - one) / out_tokens          # ms / token
                else:
                    wall, n = timed(llm, prompts[:batch], out_tokens)
                    value = n / wall                                   # tok/s
                results.setdefault((name, batch), []).append(value)
    print(f"\n## Speed ({load()}; median of {reps}, {out_tokens} output tokens)")
    print("| mode | " + " | ".join("B=1 decode ms/token" if b == 1 else f"B={b} tok/s" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    base = {b: statistics.median(results[("none", b)]) for b in batches} if "none" in llms else {}
    for name in llms:
        cells = []
        for b in batches:
            v = statistics.median(results[(name, b)])
            ratio = ""
            if base and name != "none":   # speed-up: fp32 time / mode time, or mode tok/s / fp32 tok/s
                ratio = f" ({(base[b] / v if b == 1 else v / base[b]):.2f}x)"
            cells.append(f"{v:.1f}{ratio}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def quality(ref: LLM, runs: dict[str, LLM], num_tokens: int, peer=None) -> None:
    """The quality table (module doc); `peer`: a LlamaCppScorer, scored the same way as one
    more row (llama.cpp computing with the GGUF's own weights)."""
    prompts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in PARITY_TEXTS]
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    base = [ref.generate([p + r], score, use_tqdm=False)[0].prompt_logprobs for p, r in zip(prompts, reference)]
    print(f"\n## Quality vs fp32 ({len(prompts)} parity prompts x {num_tokens} tokens; {load()})")
    print("| mode | greedy agreement | mean abs Δ logprob | first free-running divergence (per prompt) |")
    print("|---|---:|---:|---|")
    for name, llm in runs.items():
        agree = total = 0
        delta = 0.0
        for p, r, want in zip(prompts, reference, base):
            got = llm.generate([p + r], score, use_tqdm=False)[0].prompt_logprobs
            for pos in range(len(p) - 1, len(p) + len(r) - 1):
                agree += got[pos].top[0][0] == r[pos - len(p) + 1]
                delta += abs(got[pos].logprob - want[pos].logprob)
                total += 1
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        _row(name, agree, total, delta, outs, reference, num_tokens)
    if peer is not None:
        agree = total = 0
        delta = 0.0
        for p, r, want in zip(prompts, reference, base):
            top, logprobs = peer.teacher_forced(p + r, len(p) - 1)
            for j, (t, lp) in enumerate(zip(top, logprobs)):
                agree += t == r[j]
                delta += abs(lp - want[len(p) - 1 + j].logprob)
                total += 1
        outs = [peer.greedy(p, num_tokens) for p in prompts]
        _row("llama.cpp (GGUF weights, its own compute)", agree, total, delta, outs, reference, num_tokens)


def _row(name: str, agree: int, total: int, delta: float, outs: list[list[int]],
         reference: list[list[int]], num_tokens: int) -> None:
    first = [next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
    print(f"| {name} | {agree / total:.2%} | {delta / total:.3g} | {', '.join(map(str, first))} (of {num_tokens}) |")


def linear_bytes(llm: LLM) -> int:
    total = 0
    for module in llm.engine.runner.model.modules():
        if not isinstance(module, Linear) or module is llm.engine.runner.model.lm_head:
            continue
        quant = module._quant
        if quant is None:
            total += module.weight.numel() * module.weight.element_size()
        else:
            total += sum(t.numel() * t.element_size() for t in vars(quant).values() if hasattr(t, "numel"))
            if module._packed is not None:          # int4@N: the float copy for large steps
                itemsize = torch.empty((), dtype=module._packed_dtype).element_size()
                total += module.in_features * module.out_features * itemsize
    return total


def engine_args(mode: str) -> dict:
    """`int4@12` -> quantization int4 with --quantized-max-tokens 12; `none`, `int4`, ... as is
    (a `/fp32` suffix is handled by `build`)."""
    name, _, limit = mode.removesuffix("/fp32").partition("@")
    return {"quantization": name, "quantized_max_tokens": int(limit) if limit else 0}


def build(mode: str, **common) -> LLM:
    """The LLM of `mode`; `/fp32`: loaded with native bf16 switched off (module docstring)."""
    if not mode.endswith("/fp32"):
        return LLM(**engine_args(mode), **common)
    saved = linear.native_bf16
    linear.native_bf16 = lambda: False
    try:
        return LLM(**engine_args(mode), **common)
    finally:
        linear.native_bf16 = saved


def kernels(batches: list[int], reps: int) -> None:
    """Per-layer times of the default model's linear shapes: fp32 Linear (its CPU fast paths)
    vs the int4 / int8 kernels on bf16 activations, and int4 on fp32 activations."""
    from radixserve.layers.quant_linear import Int4Matmul, Int4Weight, Int8Matmul, Int8Weight

    def median_us(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    gen = torch.Generator().manual_seed(0)
    print(f"\n## Kernels, us per call, median of {reps} ({load()})")
    print("| N x K | M | fp32 Linear | int4 bf16 | int8 bf16 | int4 fp32 act |\n|---|---:|---:|---:|---:|---:|")
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n, k, generator=gen)
        dense = Linear(k, n)
        dense.load(w)
        dense.prepare()
        int4 = Int4Matmul([Int4Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                                      torch.rand(n, k // 32, generator=gen), torch.randn(n, k // 32, generator=gen))])
        int8 = Int8Matmul([Int8Weight.from_float(w)])
        for m in batches:
            x = torch.randn(m, k, generator=gen)
            xb = x.bfloat16()
            t32, t4, t8 = median_us(lambda: dense(x)), median_us(lambda: int4(xb)), median_us(lambda: int8(xb))
            sz32 = int4.scales_zeros.float()
            slow = (f"{median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4.packed, 32, sz32)):.0f}"
                    if m == 1 else "-")
            print(f"| {n} x {k} | {m} | {t32:.0f} | {t4:.0f} ({t32 / t4:.2f}x) | {t8:.0f} ({t32 / t8:.2f}x) | {slow} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,int4,int8")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quality-tokens", type=int, default=32, help="0: skip the quality tables")
    ap.add_argument("--kernels", action="store_true", help="also time single layers (fp32 vs int4 vs int8)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="add llama.cpp's own logits on the same GGUF to the quality table "
                         "(builds llama.cpp like benchmarks/peers/llama_cpp.py; default model only)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: all cores); 1 is steadier on a shared, loaded box")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(max_total_tokens=8192, chunked_prefill_size=1024, max_running_requests=128,
                  num_threads=args.threads)
    llms: dict[str, LLM] = {}
    print(f"# benchmarks/quantized.py ({load()}, {os.cpu_count()} CPUs, threads {args.threads or 'all'})\n")
    print("| mode | load s (cached) | decoder linear weights MB (lm_head: the tied fp32 embedding, plus its int8 screen for steps of <= 4 rows when quantized) |\n|---|---:|---:|")
    for mode in args.modes.split(","):
        build(mode, **common)                                # first load writes the cache
        start = time.perf_counter()
        llms[mode] = build(mode, **common)
        print(f"| {mode} | {time.perf_counter() - start:.1f} | {linear_bytes(llms[mode]) / 1e6:.1f} |")
    if args.kernels:
        kernels([int(b) for b in args.batches.split(",")], 5 * args.reps)
    speed(llms, [int(b) for b in args.batches.split(",")], args.out_tokens, args.reps)
    if "none" in llms and args.quality_tokens:
        peer = None
        if args.llama_cpp:
            from benchmarks.peers.llama_cpp_logits import LlamaCppScorer
            from radixserve.weights.paths import resolve_model_path
            peer = LlamaCppScorer(str(resolve_model_path(None)), args.threads)
        quality(llms["none"], {m: llm for m, llm in llms.items() if m != "none"}, args.quality_tokens, peer)
    print(f"\n{load()}")


if __name__ == "__main__":
    main()
