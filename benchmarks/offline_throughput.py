"""Offline throughput: the same workloads through radixserve and through HF transformers.

Run:  python benchmarks/offline_throughput.py [--workload random,shared-prefix,batch1] [--quick]

Prints tok/s for both and the ratio (radixserve / transformers), both measured in this run,
plus batch-1 decode tok/s against the memory-bandwidth roofline (weight bytes per token /
measured read bandwidth, benchmarks/roofline.py). The reference uses the same dequantized weights (fp32).
For each workload it also prints the FLOPs each side had to compute (benchmarks/flops.py), the
GFLOP/s each reached, and their FLOP ratio: the speed-up radixserve would show at equal kernel
efficiency, the ceiling of what less work alone can give.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from radixserve import LLM, SamplingParams
from radixserve.weights.paths import resolve_model_path
from flops import Dims, padded_batch_flops, serving_flops
from roofline import bandwidth_gbs


def random_workload(rng, vocab, num, lo, hi):
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(num)]


def shared_prefix_workload(rng, vocab, groups, per_group, prefix_len, suffix_len, out_len):
    items = []
    for _ in range(groups):
        prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
        for _ in range(per_group):
            items.append((prefix + [rng.randrange(100, vocab) for _ in range(suffix_len)], out_len))
    return items


def run_radixserve(llm, items):
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in items]
    llm.engine.flush_cache()
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    after = llm.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    work = [(len(o.prompt_token_ids), o.num_cached_tokens, len(o.outputs[0].token_ids)) for o in outs]
    return n_out / dt, cached / max(prompt, 1), dt, work


def run_transformers(model, items, batch_size):
    """Batched HF generate: left-padded batches in input order, greedy, no early stop."""
    n_out, t0 = 0, time.perf_counter()
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        max_new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        n_out += sum(o for _, o in chunk)  # only the tokens each request asked for count
    dt = time.perf_counter() - t0
    return n_out / dt, dt


def batch1_decode(llm, n_tokens=128):
    prompt = list(range(1000, 1512))
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    return (n_tokens - 1) / (time.perf_counter() - t0 - prefill_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="random,shared-prefix,batch1")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(None)
    llm = LLM(dtype=args.dtype, max_total_tokens=65536)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    folder, name = path.rsplit("/", 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    vocab = llm.engine.runner.vocab_size
    rng = random.Random(0)
    scale = 4 if args.quick else 1
    print(f"model {name}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    # Warm-up, both sides: first calls pack weights and allocate, which no workload should pay.
    run_radixserve(llm, random_workload(random.Random(1), vocab, 4, 16, 32))
    run_transformers(hf, random_workload(random.Random(1), vocab, 2, 4, 8), args.hf_batch_size)
    for wl in args.workload.split(","):
        if wl == "random":
            items = random_workload(rng, vocab, 64 // scale, 64, 512)
        elif wl == "shared-prefix":
            items = shared_prefix_workload(rng, vocab, 8 // min(scale, 2), 8, 768, 64, 64)
        elif wl == "batch1":
            bw = bandwidth_gbs()
            # Bytes read per decode step: every block weight plus the (tied) lm_head matrix once;
            # the embedding lookup reads one row.
            weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
            roof = bw * 1e9 / weight_bytes
            tps = batch1_decode(llm)
            print(f"[batch1] decode {tps:.1f} tok/s; bandwidth {bw:.1f} GB/s, weights "
                  f"{weight_bytes / 1e6:.0f} MB -> roofline {roof:.1f} tok/s; {tps / roof:.0%} of roofline")
            continue
        else:
            raise SystemExit(f"unknown workload {wl}")
        ours, hit, dt_ours, work = run_radixserve(llm, items)
        ref, dt_ref = run_transformers(hf, items, args.hf_batch_size)
        print(f"[{wl}] {len(items)} requests: radixserve {ours:.1f} tok/s ({dt_ours:.1f} s, hit rate "
              f"{hit:.1%}) | transformers {ref:.1f} tok/s ({dt_ref:.1f} s) | ratio {ours / ref:.2f}x")
        dims = Dims.of(llm.engine.runner.model_config)
        chunks = [items[i:i + args.hf_batch_size] for i in range(0, len(items), args.hf_batch_size)]
        hf_batches = [([len(p) for p, _ in chunk], max(o for _, o in chunk)) for chunk in chunks]
        f_ours, f_ref = serving_flops(dims, work), padded_batch_flops(dims, hf_batches)
        print(f"[{wl}] FLOPs: radixserve {f_ours / 1e12:.2f} T ({f_ours / dt_ours / 1e9:.0f} GFLOP/s) | "
              f"transformers {f_ref / 1e12:.2f} T ({f_ref / dt_ref / 1e9:.0f} GFLOP/s) | FLOP ratio "
              f"{f_ref / f_ours:.2f}x (the ratio at equal kernel efficiency)")


if __name__ == "__main__":
    main()
