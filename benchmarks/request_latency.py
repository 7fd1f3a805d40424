"""Latency of one short request outside the forward pass: the offline API (baseline), a worker over HTTP, a router.

    PYTHONPATH=. python benchmarks/request_latency.py [--requests 60] [--model-path DIR|GGUF] [-- extra serve flags]

One run, sequential requests, paired: the same 1-token greedy completion of a short prompt ("The capital of
France", 4 tokens on the default model) through (a) `radixserve.LLM` in this process, (b) `radixserve serve`
over HTTP, (c) `radixserve route` in front of that worker; then `GET /health` on the worker (no engine). A
warm-up of 5 requests each first. Prints p50 / p99 in ms, worker / offline (what HTTP, IPC and detokenizing
add), and the router's added latency per pair (router minus worker, p50 and p99). The offline requests run
before the servers start (right after one, this process's idle OpenMP threads still spin and would slow the
next HTTP request); worker and router requests alternate.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from radixserve.bench.launch import free_ports, wait_healthy

PROMPT = "The capital of France"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--model-path", default=None)
    p.add_argument("serve_args", nargs="*", help="extra `radixserve serve` flags (after --)")
    args = p.parse_args()
    from radixserve import LLM, SamplingParams
    llm = LLM(args.model_path)
    params = SamplingParams(max_tokens=1, temperature=0)
    offline = lambda: llm.generate([PROMPT], params, use_tqdm=False)  # noqa: E731
    timed(offline, 5)
    t_off = timed(offline, args.requests)
    worker_port = free_ports(2)
    router_port = worker_port + 1
    model = ["--model-path", args.model_path] if args.model_path else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--port", str(worker_port), *model,
                               *args.serve_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    worker, router = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{router_port}"
    try:
        wait_healthy(worker, procs[0])
        procs.append(subprocess.Popen([sys.executable, "-m", "radixserve.cli", "route", "--port", str(router_port),
                                       "--worker-urls", worker], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        wait_healthy(router, procs[1])
        with httpx.Client(timeout=60) as c:
            name = c.get(worker + "/v1/models").json()["data"][0]["id"]
            body = {"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}

            def post(url: str) -> None:
                r = c.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text

            for fn in (lambda: post(worker), lambda: post(router)):
                timed(fn, 5)
            t_worker, t_router = [], []
            for _ in range(args.requests):   # alternated, so drift hits both alike
                t_worker += timed(lambda: post(worker), 1)
                t_router += timed(lambda: post(router), 1)
            t_health = timed(lambda: c.get(worker + "/health"), args.requests)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    added = [r - w for r, w in zip(t_router, t_worker)]
    result = {
        "load_avg_1m": os.getloadavg()[0], "requests": args.requests,
        "offline_p50_ms": pct(t_off, 0.5), "offline_p99_ms": pct(t_off, 0.99),
        "worker_p50_ms": pct(t_worker, 0.5), "worker_p99_ms": pct(t_worker, 0.99),
        "router_p50_ms": pct(t_router, 0.5), "router_p99_ms": pct(t_router, 0.99),
        "health_p50_ms": pct(t_health, 0.5),
        "worker_over_offline": round(statistics.median(t_worker) / statistics.median(t_off), 3),
        "router_added_p50_ms": pct(added, 0.5), "router_added_p99_ms": pct(added, 0.99),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
