"""CPU time per streamed output token of the server's HTTP process and of its engine process,
read from /proc around a `radixserve bench` run (Linux only).

    PYTHONPATH=. python benchmarks/http_token_cpu.py                       # c1 and c16, 128 tokens
    PYTHONPATH=. python benchmarks/http_token_cpu.py --concurrency 1 --py-spy /tmp/http.svg \\
        --serve-args "--quantization int4 --quantized-max-tokens 12"

Why: the HTTP process (FastAPI, SSE, detokenizing) and the engine share the cores; every
millisecond of CPU the HTTP process spends per token is taken from the engine's threads (at
concurrency 1 it lengthens TPOT, at high concurrency it caps throughput). Random 256-token
prompts, `--output-len` tokens each with ignore_eos, streamed; a warm-up run first. The
HTTP process is the `radixserve serve` process, the engine its child. CPU = utime + stime from
/proc/PID/stat. `--py-spy FILE` also records the HTTP process (`pip install py-spy` first).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile

from radixserve.bench.launch import free_port, wait_healthy
from radixserve.weights.paths import resolve_model_path

REPO = pathlib.Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def bench(url: str, tokenizer: str, concurrency: int, prompts: int, output_len: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "radixserve", "bench", "--base-url", url, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", str(output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--disable-progress", "--output-file", out, "--tag", f"c{concurrency}"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(pathlib.Path(out).read_text().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-level", type=int, default=0, help="default: max(4, 2 x concurrency)")
    ap.add_argument("--serve-args", default="", help="extra `radixserve serve` flags")
    ap.add_argument("--py-spy", default=None, help="flame graph of the HTTP process (svg path, one per level; "
                    "a .txt path gives py-spy's raw collapsed stacks)")
    args = ap.parse_args()
    tokenizer = resolve_model_path(None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1", "--port",
                               str(port), "--log-level", "warning", *shlex.split(args.serve_args)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    out = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    try:
        wait_healthy(url, server)
        engines = children(server.pid)
        bench(url, tokenizer, 1, 2, 16, out)   # warm-up
        print(f"load {os.getloadavg()[0]:.2f} at start; serve args: {args.serve_args or '(defaults)'}")
        print("| concurrency | output tokens | output tok/s | TPOT p50 ms | HTTP CPU ms/token | engine CPU ms/token |")
        print("|---:|---:|---:|---:|---:|---:|")
        for c in (int(x) for x in args.concurrency.split(",")):
            spy = None
            if args.py_spy:
                stem, ext = os.path.splitext(args.py_spy)
                spy = subprocess.Popen(["py-spy", "record", "-o", f"{stem}_c{c}{ext}", "-r", "250", "--nonblocking",
                                        "--format", "raw" if ext == ".txt" else "flamegraph", "-p", str(server.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            before = cpu_s(server.pid), sum(cpu_s(p) for p in engines)
            result = bench(url, tokenizer, c, args.prompts_per_level or max(4, 2 * c), args.output_len, out)
            after = cpu_s(server.pid), sum(cpu_s(p) for p in engines)
            if spy is not None:
                spy.send_signal(signal.SIGINT)   # py-spy writes its file on SIGINT
                spy.wait()
            tokens = result["total_output_tokens"]
            http_ms, engine_ms = ((a - b) * 1000 / tokens for a, b in zip(after, before))
            print(f"| {c} | {tokens} | {result['output_throughput']:.1f} | {result['median_tpot_ms']:.2f} | "
                  f"{http_ms:.3f} | {engine_ms:.3f} |")
        print(f"load {os.getloadavg()[0]:.2f} at end")
    finally:
        server.terminate()
        server.wait(timeout=60)
        os.unlink(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
