"""N-gram speculative decoding on vs off on the default model, same run, output tok/s and the ratio.

Run:  python benchmarks/speculative.py [--rounds 2] [--draft-tokens 8] [--break-even-tokens R] [--only chat]

Workloads (greedy, offline API, one fresh engine per side, sides interleaved ABBA):
- copy-edit, concurrency 1: the model is asked to repeat a code file with one identifier
  renamed: most output tokens copy the context, where prompt lookup pays.
- chat, concurrency 16: 16 short unrelated chat questions at once (little to copy: speculation
  must back off and cost little).
Prints per side tok/s, the spec/off ratio, the acceptance counters and the load average.
Greedy outputs of both sides are compared (they must be equal).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

CODE = '''def parse_config(path):
    """Read a key=value config file into a dict."""
    config = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Who wrote Hamlet?", "Give me a synonym for happy.", "What is the boiling point of water?",
             "How many legs does a spider have?", "What is the largest planet?", "Say hello in Spanish.",
             "What color is the sky on a clear day?", "Name a famous painter.", "What is H2O?",
             "How many days are in a week?", "What is the opposite of cold?", "Name a fruit that is yellow.",
             "What do bees make?"]


def workloads():
    edit = [{"role": "user", "content": "Repeat this code exactly, but rename `config` to `settings`:\n\n" + CODE}]
    return {"copy-edit c1": ([edit], 300), "chat c16": ([[{"role": "user", "content": q}] for q in QUESTIONS], 64)}


def measure(spec: bool, args: argparse.Namespace) -> dict:
    from radixserve import LLM, SamplingParams

    kwargs = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens,
              **({"speculative_break_even_tokens": args.break_even_tokens}
                 if args.break_even_tokens is not None else {})} if spec else {}
    llm = LLM(max_total_tokens=32768, **kwargs)
    out = {}
    for name, (conversations, max_tokens) in workloads().items():
        if args.only and args.only not in name:
            continue
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        llm.chat(conversations[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
        llm.engine.flush_cache()
        before = {k: v for k, v in llm.engine.counters.items() if isinstance(v, int)}
        start = time.perf_counter()
        results = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [r.outputs[0].token_ids for r in results]
        c = {k: llm.engine.counters[k] - before[k] for k in before
             if k.startswith("spec_") and isinstance(before[k], int)}   # not the by-position lists
        out[name] = {"tok_s": sum(map(len, tokens)) / elapsed, "tokens": tokens, **c}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--break-even-tokens", type=float, default=None,
                    help="--speculative-break-even-tokens (default: the engine's)")
    ap.add_argument("--only", default="", help="run only the workloads whose name contains this")
    args = ap.parse_args()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for spec in (False, True, True, False):
            runs[spec].append(measure(spec, args))
    print(f"load {os.getloadavg()[0]:.2f}; draft tokens {args.draft_tokens}; break-even tokens "
          f"{args.break_even_tokens or 'default'}; {args.rounds} ABBA rounds")
    for name in runs[False][0]:
        off = [r[name]["tok_s"] for r in runs[False]]
        on = [r[name]["tok_s"] for r in runs[True]]
        same = all(r[name]["tokens"] == runs[False][0][name]["tokens"] for r in runs[True] + runs[False])
        last = runs[True][-1][name]
        steps, drafted, accepted = (last["spec_num_verify_steps"], last["spec_num_draft_tokens"],
                                    last["spec_num_accepted_tokens"])
        print(f"{name:14s} off {statistics.median(off):6.1f} tok/s  spec {statistics.median(on):6.1f} tok/s  "
              f"ratio {statistics.median(on) / statistics.median(off):.2f}  greedy outputs equal: {same}  "
              f"(runs off {' '.join(f'{x:.1f}' for x in off)}, spec {' '.join(f'{x:.1f}' for x in on)})  "
              f"verify steps {steps}, accepted {accepted}/{drafted} drafted "
              f"({accepted / drafted if drafted else 0:.2f})")


if __name__ == "__main__":
    main()
