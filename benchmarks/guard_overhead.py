"""Cost of the output-anomaly guard on serving: the same workload against a worker with the guard and one without, one run, ratio printed.

    python benchmarks/guard_overhead.py [--num-prompts 48] [--concurrency 16]

Two `radixserve serve` workers on the embedded default model (one with
--disable-anomaly-guard) are started side by side, one torch thread each; `radixserve bench`
(random, 256 prompt / 64 output tokens, ignore_eos, completions) runs against them in ABBA
order so drift on a shared machine hits both alike. Prints each side's mean output
throughput, TPOT and ITL p50, and guard / no-guard ratios.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from radixserve.bench.launch import free_port, wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[1]
SHOWN = (("output_throughput", "output tok/s"), ("median_tpot_ms", "TPOT p50 ms"),
         ("median_itl_ms", "ITL p50 ms"))


def bench(url: str, args: argparse.Namespace, out: str, tag: str) -> dict:
    cmd = [sys.executable, "-m", "radixserve", "bench", "--base-url", url,
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
           "--random-range-ratio", "1.0", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--flush-cache",
           "--disable-progress", "--output-file", out, "--tag", tag, "--seed", "1"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(pathlib.Path(out).read_text().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    out = tempfile.mktemp(prefix="guard-overhead-", suffix=".jsonl")
    sides = {"guard": [], "no guard": ["--disable-anomaly-guard"]}
    procs, urls = {}, {}
    try:
        for name, flags in sides.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "radixserve", "serve", "--port", str(port),
                 "--num-threads", "1", "--log-level", "warning", *flags], cwd=REPO)
        for name, proc in procs.items():
            wait_healthy(urls[name], proc, name=name)
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for name in ("guard", "no guard", "no guard", "guard"):
            runs[name].append(bench(urls[name], args, out, name))
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    for name in sides:
        print(f"{name}: output tok/s per run " +
              ", ".join(f"{r['output_throughput']:.2f}" for r in runs[name]))
    print("| metric | guard | no guard | guard / no guard |")
    print("|---|--:|--:|--:|")
    for key, label in SHOWN:
        a, b = (statistics.mean(r[key] for r in runs[n]) for n in ("guard", "no guard"))
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
