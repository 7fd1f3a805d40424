"""1 prefill + 1 decode worker vs 2 colocated workers, each behind the router, on a long-prompt mixed workload: TTFT and ITL p50/p99 from `radixserve bench`, one run each.

    python benchmarks/pd_itl.py [--num-prompts 32] [--concurrency 4] [--input-len 1024] [--model-path DIR]

Both setups get the same machine, model, flags and bench workload (random prompts of
U(0.1 L, L) tokens with L = --input-len, outputs of U(0.1 M, M) with ignore_eos). On a shared
two-core machine the two workers of either setup compete for the same cores, so throughput
cannot win; what disaggregation should show is a flatter ITL p99, since decode steps never
share a forward pass with a long prefill.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
SETUPS = {"colocated": ["--num-workers", "2"], "pd": ["--num-prefill", "1", "--num-decode", "1"]}
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


def run_setup(name: str, args: argparse.Namespace, out: pathlib.Path) -> None:
    sys.path.insert(0, str(REPO))
    from radixserve.bench.launch import free_ports
    port = free_ports(5)
    model = ["--model-path", args.model_path] if args.model_path else []
    fleet = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "fleet", *SETUPS[name], "--port", str(port),
         "--log-level", "warning", "--num-threads", str(args.threads_per_worker),
         "--max-total-tokens", "65536", *model], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or fleet.poll() is not None:
                raise RuntimeError(f"{name} fleet did not come up")
            time.sleep(1)
        subprocess.run(
            [sys.executable, "-m", "radixserve", "bench", "--base-url", f"http://127.0.0.1:{port}",
             "--dataset-name", "random", "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--random-range-ratio", "0.1",
             "--ignore-eos", "--num-prompts", str(args.num_prompts), "--max-concurrency",
             str(args.concurrency), "--seed", "14", "--output-file", str(out), "--tag", name,
             "--disable-progress"], cwd=REPO, check=True)
    finally:
        os.killpg(fleet.pid, signal.SIGTERM)
        fleet.wait(120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--model-path", default=None)
    args = p.parse_args()
    out = pathlib.Path(tempfile.mkdtemp(prefix="pd-itl-")) / "runs.jsonl"
    for name in SETUPS:
        run_setup(name, args, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"{'setup':<10}" + "".join(f"{k:>20}" for k in KEYS))
    for row in rows:
        print(f"{row.get('tag', '?'):<10}" + "".join(f"{row.get(k, float('nan')):>20.1f}" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
