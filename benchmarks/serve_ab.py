"""Two `radixserve serve` flag sets side by side: both servers up at once, bench runs alternated, medians and the ratio.

    PYTHONPATH=. python benchmarks/serve_ab.py --b-args=--disable-cascade-attention \\
        [--a-args=...] [--dataset shared-prefix|random] [--concurrency 16] [--num-prompts 32] [--rounds 3]

Serving numbers from separate runs on a shared machine move by 20 % and more between runs; a
flag's effect is only visible when both sides run in the same window. Both servers (default
model) start first and sit idle while the other is measured; rounds go A B, B A, ... with
`radixserve bench` (`--flush-cache`, `--ignore-eos`; the workloads of benchmarks/peers/llama_cpp.py).
Prints every run's output tok/s and median TPOT, then the medians and B / A.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "peers"))
from llama_cpp import bench, start  # noqa: E402  (benchmarks/peers is not a package)

from radixserve.bench.launch import free_port  # noqa: E402
from radixserve.weights.paths import resolve_model_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-args", default="", help="flags of server A (write --a-args=--flag)")
    ap.add_argument("--b-args", default="", help="flags of server B")
    ap.add_argument("--dataset", default="shared-prefix", choices=("shared-prefix", "random"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gguf = resolve_model_path(None)
    servers = {}
    for side, flags in (("A", args.a_args), ("B", args.b_args)):
        url = f"http://127.0.0.1:{free_port()}"
        port = url.rsplit(":", 1)[1]
        servers[side] = (url, start([sys.executable, "-m", "radixserve", "serve", "--port", port,
                                     *shlex.split(flags)], url, f"ab-{side}"))
    runs: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    out_dir = tempfile.mkdtemp(prefix="serve-ab-")
    try:
        for rnd in range(args.rounds):
            for side in (("A", "B") if rnd % 2 == 0 else ("B", "A")):
                result = bench(servers[side][0], gguf, args.dataset, args.concurrency, args.num_prompts,
                               os.path.join(out_dir, f"{side}{rnd}.jsonl"), side)
                runs[side].append((result["output_throughput"], result["median_tpot_ms"]))
                print(f"round {rnd} {side}: {result['output_throughput']:.1f} output tok/s, TPOT p50 "
                      f"{result['median_tpot_ms']:.1f} ms, load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
    a, b = (statistics.median(t for t, _ in runs[s]) for s in ("A", "B"))
    print(f"{args.dataset} c{args.concurrency}, {args.num_prompts} prompts, {args.rounds} rounds. "
          f"A [{args.a_args or 'defaults'}] {a:.1f} tok/s, B [{args.b_args or 'defaults'}] {b:.1f} tok/s; "
          f"B / A {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
