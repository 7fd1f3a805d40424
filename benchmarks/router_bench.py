"""Router benchmark: cache_aware vs round_robin over 2 workers (shared-prefix, multi-turn), and the router's added latency.

    python benchmarks/router_bench.py [--model-path DIR|GGUF] [--quick] [-- extra worker flags]

One run starts `radixserve fleet --num-workers 2` (a cache_aware router keyed by token ids)
and a second router with --policy round_robin over the same two workers. For each dataset and
policy it flushes both workers' prefix caches and runs `radixserve bench` through that
router (chat backend, fixed output lengths), in ABBA order (cache_aware, round_robin,
round_robin, cache_aware; --rounds 1: AB) so that drift of a shared machine hits both
policies alike; the tables show each policy's mean over its runs. Then it measures the router's added latency:
the same 1-token completions sent alternately straight to worker 0 and through the
cache_aware router, paired. Prints markdown tables with cache_aware / round_robin ratios.
Default model: the embedded SmolLM2-135M-Instruct GGUF, one torch thread per worker.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from radixserve.bench.launch import free_ports, wait_healthy
from radixserve.weights.paths import resolve_model_path

REPO = pathlib.Path(__file__).resolve().parents[1]
DATASETS = {
    "shared-prefix": ["--dataset-name", "shared-prefix", "--num-groups", "8",
                      "--prompts-per-group", "8", "--system-prompt-len", "512",
                      "--question-len", "32", "--output-len", "16"],
    "multi-turn": ["--dataset-name", "multi-turn", "--num-clients", "8", "--num-rounds", "4",
                   "--client-system-len", "128", "--user-len", "64", "--output-len", "16"],
}
QUICK = {"--num-groups": "4", "--prompts-per-group": "4", "--num-clients": "4",
         "--num-rounds": "3"}


def flush(urls: list[str]) -> None:
    for url in urls:
        r = httpx.post(url + "/flush_cache", timeout=60, trust_env=False)
        r.raise_for_status()


def bench(url: str, tokenizer: str, dataset: list[str], out: str, tag: str) -> dict:
    """One `radixserve bench` run through `url`; returns its JSON record."""
    cmd = [sys.executable, "-m", "radixserve", "bench", "--base-url", url, "--backend", "chat",
           "--tokenizer", tokenizer, "--ignore-eos", "--max-concurrency", "8",
           "--warmup-requests", "0", "--disable-progress", "--output-file", out, "--tag", tag,
           *dataset]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in pathlib.Path(out).read_text().splitlines()]
    return next(r for r in reversed(records) if r["tag"] == tag)


def added_latency(worker: str, router: str, n: int) -> dict[str, float]:
    """Same 1-token completions, alternately direct and through the router (sequential,
    keep-alive clients); returns p50/p99 in ms of each and of the paired difference."""
    direct, routed = [], []
    with httpx.Client(timeout=60, trust_env=False) as a, httpx.Client(timeout=60, trust_env=False) as b:
        model = a.get(worker + "/v1/models").json()["data"][0]["id"]
        for i in range(n + 5):
            body = {"model": model, "prompt": f"Latency probe {i % 7}", "max_tokens": 1}
            times = []
            for client, base in ((a, worker), (b, router)):
                t0 = time.perf_counter()
                r = client.post(base + "/v1/completions", json=body)
                times.append(time.perf_counter() - t0)
                r.raise_for_status()
            if i >= 5:  # the first few warm connections and caches
                direct.append(times[0] * 1000)
                routed.append(times[1] * 1000)
    diff = [r - d for r, d in zip(routed, direct)]

    def pct(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1]
    return {"direct_p50": pct(direct, 50), "direct_p99": pct(direct, 99),
            "router_p50": pct(routed, 50), "router_p99": pct(routed, 99),
            "added_p50": pct(diff, 50), "added_p99": pct(diff, 99)}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
           "cache_hit_rate")


def mean_record(runs: list[dict]) -> dict:
    """Each metric of METRICS averaged over `runs`, plus the per-run request throughputs."""
    out = {k: statistics.fmean(r[k] or 0.0 for r in runs) for k in METRICS}
    out["runs"] = " / ".join(f"{r['request_throughput']:.2f}" for r in runs)
    return out


def print_tables(results: dict, latency: dict, n: int) -> None:
    print("\n| dataset | policy | req/s (runs) | output tok/s | TTFT p50 ms | TTFT p99 ms | hit rate |")
    print("|---|---|---|---|---|---|---|")
    for name, by_policy in results.items():
        means = {policy: mean_record(runs) for policy, runs in by_policy.items()}
        for policy, r in means.items():
            print(f"| {name} | {policy} | {r['request_throughput']:.2f} ({r['runs']}) | "
                  f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
                  f"{r['p99_ttft_ms']:.0f} | {100 * r['cache_hit_rate']:.1f} % |")
        ca, rr = means["cache_aware"], means["round_robin"]
        print(f"| {name} | **cache_aware / round_robin** | "
              f"**{ratio(ca['request_throughput'], rr['request_throughput'])}** | "
              f"{ratio(ca['output_throughput'], rr['output_throughput'])} | "
              f"{ratio(ca['median_ttft_ms'], rr['median_ttft_ms'])} | "
              f"{ratio(ca['p99_ttft_ms'], rr['p99_ttft_ms'])} | "
              f"{ratio(ca['cache_hit_rate'], rr['cache_hit_rate'])} |")
    print(f"\nRouter added latency ({n} paired 1-token completions, sequential, ms):\n")
    print("| path | p50 | p99 |\n|---|---|---|")
    print(f"| direct to worker 0 | {latency['direct_p50']:.2f} | {latency['direct_p99']:.2f} |")
    print(f"| through the router | {latency['router_p50']:.2f} | {latency['router_p99']:.2f} |")
    print(f"| added (paired difference) | {latency['added_p50']:.2f} | {latency['added_p99']:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded)")
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2, help="2: ABBA order; 1: AB")
    p.add_argument("--output-file", default=os.path.join(tempfile.gettempdir(),
                                                         "router_bench.jsonl"))
    args, worker_extra = p.parse_known_args()
    model = resolve_model_path(args.model_path)
    base = free_ports(4)  # cache_aware router, worker 0, worker 1, round_robin router
    workers = [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"]
    routers = {"cache_aware": f"http://127.0.0.1:{base}",
               "round_robin": f"http://127.0.0.1:{base + 3}"}
    logs = tempfile.mkdtemp(prefix="router-bench-")
    fleet = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "fleet", "--num-workers", "2", "--port", str(base),
         "--worker-base-port", str(base + 1), "--log-dir", logs, "--tokenizer-path", model,
         "--log-level", "warning", "--model-path", model, "--num-threads", "1", *worker_extra],
        cwd=REPO, stdout=open(os.path.join(logs, "fleet.log"), "w"), stderr=subprocess.STDOUT)
    rr = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "route", "--worker-urls", *workers, "--port",
         str(base + 3), "--policy", "round_robin", "--log-level", "warning"],
        cwd=REPO, stdout=open(os.path.join(logs, "rr.log"), "w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(routers["cache_aware"], fleet, name="fleet")
        wait_healthy(routers["round_robin"], rr, name="round_robin router")
        time.sleep(2.0)  # both routers' first health sweeps see both workers
        results: dict[str, dict] = {}
        for name, flags in DATASETS.items():
            if args.quick:
                flags = [QUICK.get(prev, f) for prev, f in zip([None, *flags], flags)]
            results[name] = {policy: [] for policy in routers}
            order = (["cache_aware", "round_robin", "round_robin", "cache_aware"] * args.rounds)
            for i, policy in enumerate(order[:2 * args.rounds]):
                flush(workers)
                results[name][policy].append(bench(routers[policy], model, flags,
                                                   args.output_file, f"router/{name}/{policy}/{i}"))
                print(f"{name} {policy} run {i}: "
                      f"{results[name][policy][-1]['request_throughput']:.2f} req/s", flush=True)
        latency = added_latency(workers[0], routers["cache_aware"], args.latency_requests)
        print_tables(results, latency, args.latency_requests)
    finally:
        for proc in (rr, fleet):
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
