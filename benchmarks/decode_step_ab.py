"""Median ms per decode step of two source trees side by side: both engines up at once, measurements alternated.

    PYTHONPATH=. python benchmarks/decode_step_ab.py --base /tmp/base_tree [--batches 1,4,16] [--ctx 256,1024]
        [--steps 24] [--rounds 4] [--compile on] [--max-bs 16]

A is the tree at --base (a checkout with its C++ library built, e.g. `git archive <commit>` plus a copy of the built
radixserve/csrc/_radixserve_ops.so); B is the tree this script lives in. Each side is one worker process holding one
engine (default model, --quantization auto, --compile as given with --torch-compile-max-bs --max-bs); it idles
while the other measures. For each (batch, ctx) both workers add `batch` greedy requests of random `ctx`-token
prompts and step until every one has its first token; then --rounds times, alternating A B / B A, each side times
--steps pure decode steps (Engine.step wall clock) of those requests. Printed: the median step ms of each side over
all its timed steps, B / A, and the 1-minute load average when the cell was done. Both sides first decode fixed
prompts (one alone, then four at once); their greedy tokens and top-4 logprobs (floats, from the logits) must be
exactly equal.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = r'''
import json, random, sys, time
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
args = json.loads(sys.argv[1])
config = EngineConfig(compile=args["compile"], torch_compile_max_bs=args["max_bs"], max_total_tokens=args["kv_tokens"])
engine = Engine(config, ModelRunner.from_config(config))
rng, out = random.Random(0), {}
def step():
    for o in engine.step():
        got = [[lp.token_id, lp.top] for lp in o.new_logprobs] if o.new_logprobs else o.new_token_ids
        out[o.request_id].extend(got)
def open_(prompts, max_tokens, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    for p in prompts:
        out[f"r{len(out)}"] = []
        engine.add_request(f"r{len(out) - 1}", p, params)
    while not all(out[r] for r in engine.requests):
        step()
def timed(k):
    ms = []
    for _ in range(k):
        start = time.perf_counter()
        step()
        ms.append(1000 * (time.perf_counter() - start))
    return ms
for batch in (1, 4):
    open_([[rng.randrange(100, 30000) for _ in range(64)] for _ in range(batch)], 32, logprobs=4)
    while engine.has_unfinished():
        step()
print(json.dumps(out), flush=True)
out.clear()
for line in sys.stdin:
    cmd = json.loads(line)
    if "open" in cmd:
        open_([[rng.randrange(100, 30000) for _ in range(cmd["ctx"])] for _ in range(cmd["open"])], cmd["max_tokens"])
        print("[]", flush=True)
    elif "steps" in cmd:
        print(json.dumps(timed(cmd["steps"])), flush=True)
    else:
        for rid in list(engine.requests):
            engine.abort(rid)
        print("[]", flush=True)
'''


def start(tree: pathlib.Path, args: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args)], cwd=tree, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(worker: subprocess.Popen, cmd: dict) -> list:
    worker.stdin.write(json.dumps(cmd) + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the A tree (B: this script's tree)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", default="256,1024")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile", default="on")
    ap.add_argument("--max-bs", type=int, default=16)
    args = ap.parse_args()
    batches, lens = [int(b) for b in args.batches.split(",")], [int(c) for c in args.ctx.split(",")]
    kv_tokens = 2 * max(batches) * (max(lens) + args.steps + 64)
    conf = {"compile": args.compile, "max_bs": args.max_bs, "kv_tokens": kv_tokens}
    workers = {"A": start(pathlib.Path(args.base).resolve(), conf), "B": start(ROOT, conf)}
    tokens = {side: json.loads(w.stdout.readline()) for side, w in workers.items()}
    print(f"A = {args.base}, B = {ROOT}; --compile {args.compile} --torch-compile-max-bs {args.max_bs}; "
          f"greedy tokens and top-4 logprobs exactly equal: {tokens['A'] == tokens['B']}", flush=True)
    print(f"{'batch':>5} {'ctx':>5} {'A ms':>7} {'B ms':>7} {'B/A':>6} {'load':>5}")
    for batch in batches:
        for ctx in lens:
            steps: dict[str, list[float]] = {"A": [], "B": []}
            for w in workers.values():
                ask(w, {"open": batch, "ctx": ctx, "max_tokens": args.rounds * args.steps + 8})
            for r in range(args.rounds):
                for side in ("AB" if r % 2 == 0 else "BA"):
                    steps[side] += ask(workers[side], {"steps": args.steps})
            for w in workers.values():
                ask(w, {"close": True})
            a, b = statistics.median(steps["A"]), statistics.median(steps["B"])
            print(f"{batch:>5} {ctx:>5} {a:>7.2f} {b:>7.2f} {b / a:>6.3f} {os.getloadavg()[0]:>5.2f}", flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
