"""Server-level device check: `radixserve serve` on --device against a CPU fp32 server, greedy output compared over HTTP, then a `radixserve bench sweep`.

Run:  python benchmarks/gpu/serve_check.py --device cuda --model-dir DIR --out serve_check.json
      python benchmarks/gpu/serve_check.py --device cpu --model-dir DIR   # a dry run on CPU

DIR holds benchmarks/gpu/tiny_model.py's model (written there when absent). Two workers start
on loopback ports: the reference (--device cpu, fp32) and the one checked (--device). `radixserve
bench --check-output REF_URL` sends the same 24 random greedy prompts to both and counts
identical, tied and corrupted outputs (bench/check.py); then `radixserve bench sweep` runs the
concurrency levels of --concurrency against the checked server. Both bench records go to one
JSON; the exit status is 1 when a server fails to start, a bench fails, or an output differs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.tiny_model import build_model  # noqa: E402
from radixserve.bench.launch import free_port  # noqa: E402

WORKLOAD = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
            "--ignore-eos", "--disable-progress", "--warmup-requests", "0"]


def start(model_dir: pathlib.Path, device: str, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """A `radixserve serve` worker on a free port, fp32; (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model-path", str(model_dir), "--device", device,
           "--dtype", "float32", "--max-total-tokens", "16384", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Return once /health answers 200; RuntimeError when the worker exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server {url} not ready after {timeout_s:.0f} s")


def bench(args: list[str], record_file: pathlib.Path, log: pathlib.Path) -> list[dict]:
    """Run `radixserve bench ARGS --output-file record_file`; its JSON records (CalledProcessError on failure)."""
    record_file.unlink(missing_ok=True)
    with log.open("a") as f:
        subprocess.run([sys.executable, "-m", "radixserve", "bench", *args, "--output-file", str(record_file)],
                       cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=600)
    return [json.loads(line) for line in record_file.read_text().splitlines() if line.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-dir", type=pathlib.Path, required=True)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", default="1,8,32", help="sweep levels")
    p.add_argument("--sweep-prompts", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--out", type=pathlib.Path, help="JSON of results (default: $OUT/serve_check.json when $OUT is set)")
    args = p.parse_args()
    if not (args.model_dir / "config.json").is_file():
        build_model(args.model_dir)
    logs = pathlib.Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="serve-check-"))
    report: dict = {"device": args.device, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    procs = []
    try:
        ref, ref_url = start(args.model_dir, "cpu", logs / "serve_ref.log")
        dut, url = start(args.model_dir, args.device, logs / "serve_dut.log")
        procs = [ref, dut]
        for proc, u in ((ref, ref_url), (dut, url)):
            wait_ready(proc, u, args.startup_timeout)
        common = ["--base-url", url, "--tokenizer", str(args.model_dir), *WORKLOAD]
        records = pathlib.Path(tempfile.mkdtemp(prefix="serve-check-")) / "records.jsonl"
        (check,) = bench([*common, "--num-prompts", str(args.num_prompts), "--check-output", ref_url],
                         records, logs / "bench.log")
        report["check_output"] = check["check_output"]
        report["sweep"] = bench(["sweep", *common, "--num-prompts", str(args.sweep_prompts),
                                 "--concurrency", args.concurrency, "--plot", ""], records, logs / "bench.log")
        counts = check["check_output"]
        report["passed"] = (counts["corrupted"] == counts["failed"] == counts["no_reference"] == 0
                            and counts["compared"] == args.num_prompts)
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        report.update(passed=False, error=str(exc))
        for log in sorted(logs.glob("*.log")):
            print(f"--- {log.name} (last 3000 characters)\n{log.read_text()[-3000:]}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "serve_check.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("passed", "check_output", "error")}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
