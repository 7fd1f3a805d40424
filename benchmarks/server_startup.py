"""Time from `radixserve serve` to the first served completion, cold (empty ~/.cache/radixserve) and warm.

    python benchmarks/server_startup.py [--runs 3] [-- extra serve flags]

Cold runs point HOME at an empty temporary folder (and unset RADIXSERVE_CACHE_DIR), so the
GGUF dequantization cache and the converted tokenizer are rebuilt; warm runs reuse the
folder the first cold run filled. Prints one line per run and a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from radixserve.bench.launch import free_port


def time_to_first_request(home: str, extra: list[str]) -> float:
    """Seconds from spawning `radixserve serve` to a 200 from a 1-token completion."""
    port = free_port()
    env = {**os.environ, "HOME": home}
    env.pop("RADIXSERVE_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--log-level",
           "warning", *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"prompt": "Hi", "max_tokens": 1})
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="flags passed to `radixserve serve`")
    args = parser.parse_args()
    cold, warm = [], []
    warm_home = tempfile.mkdtemp(prefix="radixserve-home-")
    for i in range(args.runs):
        home = warm_home if i == 0 else tempfile.mkdtemp(prefix="radixserve-home-")
        cold.append(time_to_first_request(home, args.extra))
        print(f"cold run {i + 1}: {cold[-1]:.2f} s", flush=True)
    for i in range(args.runs):
        warm.append(time_to_first_request(warm_home, args.extra))
        print(f"warm run {i + 1}: {warm[-1]:.2f} s", flush=True)
    print("\n| start | median s | min s | max s |\n|---|---|---|---|")
    for name, xs in (("cold (empty ~/.cache/radixserve)", cold), ("warm", warm)):
        print(f"| {name} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")


if __name__ == "__main__":
    main()
