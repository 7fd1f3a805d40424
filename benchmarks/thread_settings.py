"""Engine thread count on a machine the HTTP process shares: the default model served with each
`--num-threads` setting in turn, the same requests, one run, ratios to the first setting.

    PYTHONPATH=. python benchmarks/thread_settings.py                      # 1 and all cores
    PYTHONPATH=. python benchmarks/thread_settings.py --threads 1,2 --rounds 2

The HTTP process (uvicorn, detokenizing, SSE) runs beside the engine process on the same
cores (issue 17 item 3). Each setting gets a fresh server; `radixserve bench` measures
random prompts at concurrency 1 (median TPOT, what a single user feels) and at concurrency 16
(output tok/s). Rounds alternate the settings (A B, B A, ...) so drift in the machine's load
lands on both; the reported value is the median over rounds.
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

from radixserve.bench.launch import free_port, wait_healthy
from radixserve.weights.paths import resolve_model_path

REPO = pathlib.Path(__file__).resolve().parents[1]
LEVELS = {  # name -> (concurrency, prompts, metric key in bench's JSON line)
    "c1 TPOT ms": (1, 6, "median_tpot_ms"),
    "c16 output tok/s": (16, 32, "output_throughput"),
}


def bench(url: str, concurrency: int, num_prompts: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "radixserve", "bench", "--base-url", url,
           "--tokenizer", resolve_model_path(None), "--dataset-name", "random",
           "--random-input-len", "256", "--random-output-len", "48", "--random-range-ratio", "1.0",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--flush-cache", "--disable-progress", "--output-file", out]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(pathlib.Path(out).read_text().splitlines()[-1])


def measure(threads: int, out: str) -> dict[str, float]:
    """One fresh server with --num-threads `threads`; every LEVELS metric."""
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1",
                             "--port", url.rsplit(":", 1)[1], "--num-threads", str(threads),
                             "--log-level", "warning"], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, 600, f"server --num-threads {threads}")
        bench(url, 1, 2, out)   # warm-up
        return {name: bench(url, c, n, out)[key] for name, (c, n, key) in LEVELS.items()}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 2}")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    settings = [int(t) for t in args.threads.split(",")]
    results: dict[int, list[dict[str, float]]] = {t: [] for t in settings}
    print(f"load {os.getloadavg()[0]:.2f} at start; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for t in (settings if r % 2 == 0 else settings[::-1]):
                results[t].append(measure(t, os.path.join(tmp, "bench.jsonl")))
                print(f"round {r} threads {t}: {results[t][-1]}", flush=True)
    base = settings[0]
    print(f"\n| --num-threads | {' | '.join(LEVELS)} | ratio to {base} thread(s) |")
    print("|---:|" + "---:|" * len(LEVELS) + "---|")
    for t in settings:
        med = {k: statistics.median(m[k] for m in results[t]) for k in LEVELS}
        ref = {k: statistics.median(m[k] for m in results[base]) for k in LEVELS}
        ratios = ", ".join(f"{k} {med[k] / ref[k]:.2f}" for k in LEVELS)
        print(f"| {t} | {' | '.join(f'{med[k]:.1f}' for k in LEVELS)} | {ratios} |")
    print(f"load {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
