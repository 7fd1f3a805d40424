"""Host KV tier: tiers off vs on in one run (hit rate, TTFT, throughput), warm start, and the corruption soak.

    PYTHONPATH=. python benchmarks/hicache.py bench [--model-path P] [--device-tokens N] [--workloads W,...]
    PYTHONPATH=. python benchmarks/hicache.py warm  [--model-path P]
    PYTHONPATH=. python benchmarks/hicache.py soak  [--model-path P] [--num-prompts 10000]
                                                    [--concurrency 32] [--delay-ms 2 --jitter-ms 2]
                                                    [--device-tokens N] [--host-ratio R] [--wave-clients N]

bench: one `radixserve serve` at a time (2 cores), device KV pool of --device-tokens; side
"off" is the radix cache alone, side "on" adds the host tier (ratio 4). Workloads: bench's
multi-turn and agent datasets sized so the working set is about 4x the device pool. Prints per
side and workload the hit rate, TTFT p50/p99, output tok/s, and on/off ratios, with the load.
The agent workloads: every session on one shared repository context (`agent`), or sessions
spread over four repositories (`agent-repos`, the traffic of several agents on several repos).

warm: TTFT of the first 64 requests of a shared-prefix burst on a fresh server: cold; after a
restart over the same --hicache-storage-dir that served the burst (disk-warm); and with
--warmup-prompts holding the burst's shared prefixes (prompt-warm).

soak: a reference server (tier off, large pool) saves every greedy output (bench --save-output);
then a server with the tier on and a small device pool, with the hicache.h2d.layer fault
delaying each layer's load U(delay - jitter, delay + jitter) ms, serves the same requests at
--concurrency with bench --check-output: corrupted outputs per 10k (first differing position
and its top-2 gap) and guard aborts per 10k. Requests come in waves (--wave-clients
conversations of 5 turns each, one wave after another, default one wave): every client's next
turn waits behind the wave's other clients, so the host tier must hold a wave's conversations
to serve anything (--host-ratio); the soak fails when it served no prompt token. Waves let a
model with large KV (the default model: 46 KB per token) soak 10,000 requests in a host tier
that fits in memory.
tests/api/test_api_hicache.py runs the checked run (check_under_delays) scaled down on the tiny
model in CI, with the session's tier-off tiny server as the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import httpx

from radixserve.bench import check
from radixserve.bench.launch import free_port, wait_healthy

WORKLOADS = {   # bench arguments; working sets 21-23k tokens, 3.5-3.7x the default --device-tokens
    "multi-turn": ["--dataset-name", "multi-turn", "--num-clients", "8", "--num-rounds", "4",
                   "--client-system-len", "2400", "--user-len", "120", "--output-len", "16",
                   "--max-concurrency", "4"],
    "agent": ["--dataset-name", "agent", "--num-sessions", "10", "--num-turns", "4",
              "--context-len", "3000", "--task-len", "150", "--tool-len", "300",
              "--output-len", "16", "--max-concurrency", "3"],
    # agents on four repositories (session i on repository i % 4): three sessions in flight
    # always span three repositories, more than the device pool holds (~21k tokens in all)
    "agent-repos": ["--dataset-name", "agent", "--num-sessions", "8", "--num-turns", "4",
                    "--num-contexts", "4", "--context-len", "2500", "--task-len", "150",
                    "--tool-len", "300", "--output-len", "16", "--max-concurrency", "3"],
}


class Server:
    """`radixserve serve` on a free port with `args`; a context manager that stops it."""

    def __init__(self, args: list[str], model_path: str | None, log: pathlib.Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = ["--model-path", model_path] if model_path else []
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port",
                                      str(self.port), *model, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        wait_healthy(self.url, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def post(self, path: str, **body) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, trust_env=False)


def bench(url: str, args: list[str], out: pathlib.Path) -> dict:
    """One `radixserve bench` run against `url`; its JSON record."""
    if out.exists():
        out.unlink()
    subprocess.run([sys.executable, "-m", "radixserve", "bench", "--base-url", url,
                    "--disable-progress", "--output-file", str(out), "--seed", "1", *args],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().splitlines()[-1])


def run_bench(a: argparse.Namespace, tmp: pathlib.Path) -> None:
    pool = ["--max-total-tokens", str(a.device_tokens)]
    sides = {"off": pool, "on": [*pool, "--enable-hierarchical-cache", "--hicache-ratio", "4"]}
    rows: dict[str, dict[str, dict]] = {}
    for side, args in sides.items():
        with Server(args, a.model_path, tmp / f"{side}.log") as s:
            for name in a.workloads.split(","):
                wargs = WORKLOADS[name]
                s.post("/flush_cache")
                rows.setdefault(name, {})[side] = bench(s.url, wargs, tmp / "b.jsonl")
    print(f"load {os.getloadavg()[0]:.2f}; device pool {a.device_tokens} tokens")
    for name, r in rows.items():
        for side in sides:
            x = r[side]
            print(f"{name:10s} {side:3s} hit rate {x['cache_hit_rate']:.3f}  TTFT p50 "
                  f"{x['median_ttft_ms']:8.1f} ms  p99 {x['p99_ttft_ms']:8.1f} ms  "
                  f"{x['output_throughput']:6.1f} out tok/s")
        on, off = r["on"], r["off"]
        print(f"{name:10s} on/off: hit rate x{on['cache_hit_rate'] / max(off['cache_hit_rate'], 1e-9):.2f}"
              f"  TTFT p50 x{on['median_ttft_ms'] / off['median_ttft_ms']:.2f}"
              f"  p99 x{on['p99_ttft_ms'] / off['p99_ttft_ms']:.2f}"
              f"  throughput x{on['output_throughput'] / off['output_throughput']:.2f}")


def run_warm(a: argparse.Namespace, tmp: pathlib.Path) -> None:
    burst = ["--dataset-name", "shared-prefix", "--num-groups", "8", "--prompts-per-group", "8",
             "--system-prompt-len", "1500", "--question-len", "60", "--output-len", "8",
             "--max-concurrency", "8"]
    pool = ["--max-total-tokens", "65536"]
    store = ["--enable-hierarchical-cache", "--hicache-storage-dir", str(tmp / "kv")]
    warm_file = tmp / "warm.jsonl"
    results = {}
    with Server(pool, a.model_path, tmp / "cold.log") as s:
        results["cold"] = bench(s.url, burst, tmp / "w.jsonl")
    with Server([*pool, *store], a.model_path, tmp / "fill.log") as s:
        bench(s.url, burst, tmp / "w.jsonl")
    with Server([*pool, *store], a.model_path, tmp / "disk.log") as s:
        results["disk-warm"] = bench(s.url, burst, tmp / "w.jsonl")
    from radixserve.bench.cli import add_run_args, build_workload
    from radixserve.tokenizer.tokenizer import Tokenizer
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    wl = build_workload(parser.parse_args([*burst, "--seed", "1"]),
                        Tokenizer.load(a.model_path or _default_model()).hf)
    # Each group's shared head: the longest common prefix of the prompts with its system text.
    groups: dict[str, list[str]] = {}
    for s in wl.sessions:
        for r in s.requests:
            groups.setdefault(r.messages[0]["content"], []).append(r.prompt)
    heads = [json.dumps({"prompt": os.path.commonprefix(p)}) for p in groups.values()]
    warm_file.write_text("\n".join(heads) + "\n")
    with Server([*pool, "--warmup-prompts", str(warm_file)], a.model_path, tmp / "pw.log") as s:
        results["prompt-warm"] = bench(s.url, burst, tmp / "w.jsonl")
    print(f"load {os.getloadavg()[0]:.2f}; first 64 requests of a shared-prefix burst after start")
    for name, x in results.items():
        print(f"{name:12s} TTFT p50 {x['median_ttft_ms']:8.1f} ms  p99 {x['p99_ttft_ms']:8.1f} ms  "
              f"hit rate {x['cache_hit_rate']:.3f}  x{x['median_ttft_ms'] / results['cold']['median_ttft_ms']:.2f} of cold")


def _default_model() -> str:
    from radixserve.weights.paths import resolve_model_path
    return str(resolve_model_path(None))


def soak_waves(num_prompts: int, concurrency: int, wave_clients: int | None = None,
               system_len: int = 200, user_len: int = 40, output_len: int = 12) -> list[list[str]]:
    """bench arguments of the soak, one list per wave. A wave is `wave_clients` multi-turn
    conversations of 5 turns (each turn reuses, and after eviction reloads, the previous one's
    KV); waves run one after another with seeds 1, 2, ... so their prompts differ, num_prompts
    requests in all, rounded up to whole waves. A client's next turn comes about `wave_clients`
    requests after its last, so the host tier must hold that many conversations. None: one
    wave of num_prompts / 5 clients."""
    rounds = 5
    clients = max(wave_clients or num_prompts // rounds, concurrency)
    waves = max(1, -(-num_prompts // (clients * rounds)))
    return [["--dataset-name", "multi-turn", "--num-clients", str(clients), "--num-rounds", str(rounds),
             "--client-system-len", str(system_len), "--user-len", str(user_len), "--output-len",
             str(output_len), "--max-concurrency", str(concurrency), "--seed", str(w + 1)]
            for w in range(waves)]


def check_under_delays(url: str, waves: list[tuple[list[str], str]], delay_ms: float,
                       jitter_ms: float, out: pathlib.Path, api_key: str | None = None) -> dict:
    """Arm hicache.h2d.layer (each layer's load waits U(delay - jitter, delay + jitter) ms) on
    the tier server at `url`, run each wave's bench arguments against it with --check-output its
    reference (a saved file or a tier-off server's URL), clear the fault; bench's check reports
    merged, plus the server's load (partial loads too) and host-hit counters."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(url + "/admin/fault", json={"kind": "hicache.h2d.layer", "latency_ms": delay_ms,
                                               "jitter_ms": jitter_ms, "fail_fraction": 0.0},
                   headers=headers, timeout=30, trust_env=False)
    r.raise_for_status()
    try:
        key = ["--api-key", api_key] if api_key else []
        reports = [bench(url, [*work, *key, "--check-output", ref], out)["check_output"]
                   for work, ref in waves]
    finally:
        httpx.delete(url + "/admin/fault", headers=headers, timeout=30, trust_env=False)
    stats = httpx.get(url + "/get_server_info", headers=headers, timeout=30, trust_env=False).json()["engine"]
    return {**check.merge(reports), "waves": len(reports), "hicache_loads": stats["hicache_loads"],
            "hicache_partial_loads": stats["hicache_partial_loads"],
            "num_cached_tokens_host": stats["num_cached_tokens_host"]}


def soak(model_path: str | None, num_prompts: int, concurrency: int, delay_ms: float,
         jitter_ms: float, device_tokens: int, tmp: pathlib.Path, host_ratio: float = 8.0,
         wave_clients: int | None = None) -> dict:
    """The soak (module doc): each wave's tier-off reference run saved, then the checked runs
    with a host tier of `host_ratio` x the device pool, which must hold a wave's conversations."""
    waves = soak_waves(num_prompts, concurrency, wave_clients)
    refs = [str(tmp / f"ref{w}.jsonl") for w in range(len(waves))]
    with Server(["--max-total-tokens", "65536"], model_path, tmp / "ref.log") as s:
        for work, ref in zip(waves, refs):
            bench(s.url, [*work, "--save-output", ref], tmp / "s.jsonl")
    print(f"reference saved ({len(waves)} waves), load {os.getloadavg()[0]:.2f}", flush=True)
    args = ["--max-total-tokens", str(device_tokens), "--enable-hierarchical-cache", "--hicache-ratio", str(host_ratio),
            "--enable-fault-injection"]
    with Server(args, model_path, tmp / "tier.log") as s:
        return check_under_delays(s.url, list(zip(waves, refs)), delay_ms, jitter_ms, tmp / "s.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("bench", "warm", "soak"))
    p.add_argument("--model-path", default=None)
    p.add_argument("--device-tokens", type=int, default=6144,
                   help="device KV pool (must hold the longest prompt: ~4.9k tokens)")
    p.add_argument("--num-prompts", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--host-ratio", type=float, default=8.0, help="soak: host tier / device pool")
    p.add_argument("--wave-clients", type=int, default=None,
                   help="soak: conversations per wave (default: one wave of num-prompts / 5)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="bench: comma-separated, of "
                   + ", ".join(WORKLOADS))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        if a.mode == "bench":
            run_bench(a, tmp)
        elif a.mode == "warm":
            run_warm(a, tmp)
        else:
            report = soak(a.model_path, a.num_prompts, a.concurrency, a.delay_ms, a.jitter_ms,
                          a.device_tokens, tmp, a.host_ratio, a.wave_clients)
            print(f"load {os.getloadavg()[0]:.2f}; " + json.dumps(report))
            if not report["num_cached_tokens_host"]:
                raise SystemExit("the host tier served no prompt token, so this soak tested nothing: "
                                 "raise --host-ratio until it holds a wave's conversations")
            if report["corrupted"] or report["failed"] or report["no_reference"]:
                raise SystemExit(f"{report['corrupted']} corrupted, {report['failed']} failed and "
                                 f"{report['no_reference']} unreferenced outputs")


if __name__ == "__main__":
    main()
