"""A cached 1-token request on radixserve vs llama.cpp's server (llama-server), same GGUF, one run, alternated.

    PYTHONPATH=. python benchmarks/peers/llama_cpp_latency.py [--requests 60] [--radixserve-args "..."]

Each server gets the same greedy `/v1/completions` request with `max_tokens: 1`, sequentially, over one
kept-alive connection per server; requests alternate between the servers so drift hits both alike. Two
prompts: a short one ("The capital of France", 4 tokens on the default model) and a long one (about 300
tokens). A warm-up of 5 requests each first, so the prompt is cached on both (llama.cpp keeps a slot's
prompt; radixserve's radix cache holds all but the last token). Prints p50 / p99 in ms per server and
prompt, and radixserve / llama.cpp at p50. llama-server is the build `benchmarks/peers/llama_cpp.py` makes.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import httpx

from benchmarks.peers.llama_cpp import build_llama_server, start
from radixserve.bench.launch import free_port
from radixserve.weights.paths import resolve_model_path

SHORT = "The capital of France"
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the farmer counts his sheep."] * 18)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--llama-server", help="path of a built llama-server (default: build it)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--radixserve-args", default="", help="extra `radixserve serve` flags")
    args = p.parse_args()
    gguf = resolve_model_path(None)
    binary = args.llama_server or str(build_llama_server())
    peer_url, ours_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    peer = start([binary, "-m", gguf, "--host", "127.0.0.1", "--port", peer_url.rsplit(":", 1)[1],
                  "--parallel", "1", "-c", "2048", "-t", str(args.threads), "--no-webui"], peer_url, "llama-server")
    ours = start([sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1",
                  "--port", ours_url.rsplit(":", 1)[1], "--log-level", "warning",
                  *shlex.split(args.radixserve_args)], ours_url, "radixserve")
    result = {"load_avg_1m_start": os.getloadavg()[0], "requests": args.requests}
    try:
        with httpx.Client(timeout=120) as c:
            for label, prompt in (("short", SHORT), ("long", LONG)):
                times: dict[str, list[float]] = {"llama.cpp": [], "radixserve": []}
                urls = {"llama.cpp": peer_url, "radixserve": ours_url}
                for i in range(5 + args.requests):
                    for name, url in urls.items():
                        t = time.perf_counter()
                        r = c.post(url + "/v1/completions",
                                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
                        ms = (time.perf_counter() - t) * 1e3
                        assert r.status_code == 200, r.text
                        if i >= 5:
                            times[name].append(ms)
                for name, ts in times.items():
                    result[f"{label}_{name}_p50_ms"] = pct(ts, 0.5)
                    result[f"{label}_{name}_p99_ms"] = pct(ts, 0.99)
                result[f"{label}_ratio_p50"] = round(
                    statistics.median(times["radixserve"]) / statistics.median(times["llama.cpp"]), 3)
    finally:
        for proc in (peer, ours):
            proc.terminate()
            proc.wait(30)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
