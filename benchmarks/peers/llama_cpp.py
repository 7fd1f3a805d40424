"""radixserve vs llama.cpp's own server (llama-server) on the same GGUF file, same workloads, one run; prints metrics side by side with ratios.

    python benchmarks/peers/llama_cpp.py                       # build llama-server if needed, run all
    python benchmarks/peers/llama_cpp.py --concurrency 1,16 --datasets shared-prefix

llama-server is built from the llama-cpp-python source distribution (fetched with pip, the only
registry this project reaches) with a portable AVX2 build: ggml's AMX-INT8 path crashes on
quantized models on this CPU, so AMX and AVX-512 are off. The peer computes with
the GGUF's 4-bit weights and 8-bit activations (Q4_1 x Q8 kernels); radixserve at its defaults with the same
4-bit weights and fp32 activations (--quantization auto: int4-fp32; --compile auto), so the ratio compares
engines *and* activation formats.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import tempfile

from radixserve.bench.launch import free_port, wait_healthy
from radixserve.weights.paths import resolve_model_path

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path.home() / ".cache" / "radixserve" / "llama.cpp"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_BF16=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32",
               "--random-range-ratio", "1.0"],
    "shared-prefix": ["--dataset-name", "shared-prefix", "--system-prompt-len", "512",
                      "--question-len", "32", "--output-len", "32"],
}
SHOWN = [("total_throughput", "throughput tok/s"), ("output_throughput", "output tok/s"),
         ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
         ("median_tpot_ms", "TPOT p50 ms"), ("cache_hit_rate", "hit rate")]


def build_llama_server() -> pathlib.Path:
    """llama-server from the llama-cpp-python sdist, cached under ~/.cache/radixserve/llama.cpp."""
    found = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-deps",
                    "--no-binary", ":all:", "-d", str(CACHE)], check=True)
    sdist = sorted(glob.glob(str(CACHE / "llama_cpp_python-*.tar.gz")))[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(CACHE, filter="data")
    src = pathlib.Path(sdist.removesuffix(".tar.gz")) / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   cwd=src, check=True)
    return src / "build" / "bin" / "llama-server"


def start(cmd: list[str], url: str, name: str, timeout_s: float = 300) -> subprocess.Popen:
    """Spawn `cmd` with output to a temporary log and wait for its /health; exits on failure."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"peer-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(url, proc, timeout_s, name)
    except RuntimeError as exc:
        proc.terminate()
        sys.exit(f"{exc}; log: {log.name}")
    return proc


def bench(url: str, gguf: str, workload: str, concurrency: int, num_prompts: int, out: str, tag: str) -> dict:
    extra = (["--num-groups", str(max(1, num_prompts // 8)), "--prompts-per-group", "8"]
             if workload == "shared-prefix" else ["--num-prompts", str(num_prompts)])
    cmd = [sys.executable, "-m", "radixserve", "bench", "--base-url", url, "--tokenizer", gguf,
           *WORKLOADS[workload], *extra, "--max-concurrency", str(concurrency), "--ignore-eos",
           "--flush-cache", "--disable-progress", "--output-file", out, "--tag", tag]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(pathlib.Path(out).read_text().splitlines()[-1])


def ratio(a, b) -> str:
    return "-" if not a or b is None else f"{b / a:.2f}x"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--datasets", default="random,shared-prefix")
    p.add_argument("--prompts-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    p.add_argument("--llama-server", help="path of a built llama-server (default: build it)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--output-file", default="peers_llama_cpp.jsonl")
    p.add_argument("--radixserve-args", default="",
                   help="extra `radixserve serve` flags, e.g. \"--quantization int4 --quantized-max-tokens 12\"")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    gguf = resolve_model_path(None)
    binary = pathlib.Path(args.llama_server) if args.llama_server else build_llama_server()
    ctx_per_slot = 2048
    peer_url, ours_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    peer = start([str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", peer_url.rsplit(":", 1)[1],
                  "--parallel", str(max(levels)), "-c", str(ctx_per_slot * max(levels)),
                  "--cont-batching", "-t", str(args.threads), "--no-webui"], peer_url, "llama-server")
    ours = start([sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1",
                  "--port", ours_url.rsplit(":", 1)[1], "--log-level", "warning",
                  *shlex.split(args.radixserve_args)], ours_url, "radixserve")
    rows = []
    try:
        for workload in args.datasets.split(","):
            for c in levels:
                n = args.prompts_per_level or max(8, 2 * c)
                pair = {}
                for name, url in (("llama.cpp", peer_url), ("radixserve", ours_url)):
                    pair[name] = bench(url, gguf, workload, c, n, args.output_file, f"{name}/{workload}/c{c}")
                for key, label in SHOWN:
                    a, b = pair["llama.cpp"].get(key), pair["radixserve"].get(key)
                    rows.append((workload, c, label, a, b, ratio(a, b)))
    finally:
        for proc in (peer, ours):
            proc.terminate()
            proc.wait(30)
    print("| workload | concurrency | metric | llama.cpp | radixserve | radixserve / llama.cpp |")
    print("|---|--:|---|--:|--:|--:|")
    for w, c, label, a, b, r in rows:
        fa = "-" if a is None else f"{a:.2f}"
        fb = "-" if b is None else f"{b:.2f}"
        print(f"| {w} | {c} | {label} | {fa} | {fb} | {r} |")
    print("\nllama.cpp computes with the GGUF's 4-bit (Q4_1) weights; radixserve serve flags: "
          + (args.radixserve_args or "none (the defaults: --quantization auto = int4-fp32, --compile auto)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
