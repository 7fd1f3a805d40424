"""A/B offline throughput of two commits (or two configs) in one run, interleaved ABBA, ratio printed.

Run:  python benchmarks/runner_ab.py --base e92359c                      # old commit vs this tree
      python benchmarks/runner_ab.py --base HEAD --b-args '{"kv_cache_dtype": "fp8_e4m3"}'

`--base` is checked out into a temporary git worktree; B is the working tree this script lives
in. Each round runs one fresh process per side (A, B, B, A, ...) over the same workloads on the
embedded default model through the public offline API (`LLM(**args).generate`), greedy,
`ignore_eos`, and reports output tok/s. The ratio B / A is the median over rounds; the spread
says how noisy the machine was. Workloads: random (16 requests, in/out U[64, 256]),
shared-prefix (2 groups x 8, 512-token prefix + 32 suffix, 64 out), batch1 (one 512-token
prompt, 64 decoded tokens, prefill time subtracted).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = r'''
import json, random, sys, time
from radixserve import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(max_total_tokens=32768, **args)
vocab = llm.engine.runner.vocab_size
rng = random.Random(0)
def run(items):
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in items]
    llm.engine.flush_cache()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
rand = [([rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))], rng.randint(64, 256)) for _ in range(16)]
shared = []
for _ in range(2):
    prefix = [rng.randrange(100, vocab) for _ in range(512)]
    shared += [(prefix + [rng.randrange(100, vocab) for _ in range(32)], 64) for _ in range(8)]
prompt = [rng.randrange(100, vocab) for _ in range(512)]
run([(prompt, 1)])
t0 = time.perf_counter(); run([(prompt, 1)]); prefill = time.perf_counter() - t0
t0 = time.perf_counter(); run([(prompt, 64)]); batch1 = 63 / (time.perf_counter() - t0 - prefill)
print(json.dumps({"random": run(rand), "shared-prefix": run(shared), "batch1": batch1}))
'''


def measure(tree: pathlib.Path, llm_args: dict) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(llm_args)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git ref of side A")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs both sides twice)")
    ap.add_argument("--a-args", default="{}", help="JSON kwargs for LLM on side A")
    ap.add_argument("--b-args", default="{}", help="JSON kwargs for LLM on side B")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base],
                       check=True, capture_output=True)
        try:
            sides = {"A": (base, json.loads(args.a_args)), "B": (ROOT, json.loads(args.b_args))}
            results: dict[str, list[dict]] = {"A": [], "B": []}
            for _ in range(args.rounds):
                for side in "ABBA":
                    results[side].append(measure(*sides[side]))
                    print(f"  {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[side][-1].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"A = {args.base} {args.a_args}, B = working tree {args.b_args}; load {os.getloadavg()[0]:.2f}")
    for workload in results["A"][0]:
        a = [r[workload] for r in results["A"]]
        b = [r[workload] for r in results["B"]]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{workload:14s} A {statistics.median(a):7.1f} tok/s  B {statistics.median(b):7.1f} tok/s  "
              f"B/A {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
