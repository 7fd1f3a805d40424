"""Engine-level device check: the offline API on a tiny random Llama, greedy output against a CPU fp32 run in the same process.

Run:  python benchmarks/gpu/engine_check.py --device cuda --out engine_check.json
      python benchmarks/gpu/engine_check.py --device cpu   # seconds; the suite's smoke run

The model is benchmarks/gpu/tiny_model.py's (written to --model-dir, else a temporary folder).
Workload: 24 greedy requests (16 new tokens each, ignore_eos, top-2 logprobs) in 8 groups that
share a 48-token prefix: the groups' first requests, then the other 16 in one batch, which hit
the radix cache (or the host tier). The reference is `radixserve.LLM` on CPU, fp32, torch
backend, a large KV pool. Each check builds one LLM on --device and runs the same workload:

  default     the default attention backend (triton on CUDA where installed)
  torch       --attention-backend torch
  triton      --attention-backend triton (on CPU under the Triton interpreter; skipped without triton)
  ngram       --speculative-algorithm ngram
  host_tier   --enable-hierarchical-cache over a small KV pool (prefixes reloaded from host)
  small_pool  a small KV pool: requests are preempted and recomputed
  bf16, fp8_kv  reported only: they are expected to diverge from fp32

A gated check passes when every request's tokens equal the reference's up to a tie (the first
difference is where the reference's top-2 logprob gap is below --tie-gap, bench/check.py's rule)
and its feature did run (radix hits, preemptions, host loads, verify steps: EXPECT). One JSON
of results goes to --out; the exit status is 1 when a gated check fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.gpu.tiny_model import VOCAB_SIZE, build_model  # noqa: E402

NUM_GROUPS, PER_GROUP, PREFIX_LEN, SUFFIX_LEN, MAX_TOKENS = 8, 3, 48, 8, 16
SMALL_POOL = 24 * 16        # tokens: fewer pages than the 16 requests of the second batch need
BASE = {"dtype": "float32", "page_size": 16, "max_total_tokens": 8192, "chunked_prefill_size": 256,
        "quantization": "none"}
CHECKS = {
    "default": {},
    "torch": {"attention_backend": "torch"},
    "triton": {"attention_backend": "triton"},
    "ngram": {"speculative_algorithm": "ngram"},
    "host_tier": {"enable_hierarchical_cache": True, "max_total_tokens": SMALL_POOL},
    "small_pool": {"max_total_tokens": SMALL_POOL},
    "bf16": {"dtype": "bfloat16"},
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
}
REPORT_ONLY = ("bf16", "fp8_kv")
EXPECT = {  # check: (engine stat, why it must be > 0)
    "default": ("num_cached_tokens", "radix hits"),
    "host_tier": ("num_cached_tokens_host", "prefixes reloaded from the host tier"),
    "small_pool": ("num_preemptions", "preemptions"),
    "ngram": ("spec_num_verify_steps", "verify steps"),
}


def workload(seed: int = 0) -> list[list[list[int]]]:
    """Two batches of prompts (token ids): the first request of each group, then the rest."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]  # noqa: E731
    groups = [[prefix + ids(SUFFIX_LEN) for _ in range(PER_GROUP)] for prefix in
              (ids(PREFIX_LEN) for _ in range(NUM_GROUPS))]
    return [[g[0] for g in groups], [p for g in groups for p in g[1:]]]


def run(model_dir: pathlib.Path, device: str, fields: dict) -> tuple[list[list], dict, float]:
    """Greedy outputs of one LLM over the workload: ([(token, top-2 gap)] per request, stats, seconds)."""
    from radixserve.llm import LLM
    from radixserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    start = time.perf_counter()
    llm = LLM(str(model_dir), device=device, **{**BASE, **fields})
    outputs = []
    for batch in workload():
        for result in llm.generate(batch, params, use_tqdm=False):
            out = result.outputs[0]
            outputs.append([(lp.token_id, top_gap(lp.top)) for lp in out.logprobs])
    stats = {k: v for k, v in llm.stats().items() if isinstance(v, (int, float))}
    return outputs, stats, time.perf_counter() - start


def top_gap(top: list[tuple[int, float]]) -> float | None:
    return top[0][1] - top[1][1] if len(top) >= 2 else None


def compare(reference: list[list], outputs: list[list], tie_gap: float) -> dict:
    """Per-request verdicts as bench/check.py counts them: identical, tie, or mismatch (first index)."""
    counts, mismatches = {"identical": 0, "ties": 0}, []
    for i, (want, got) in enumerate(zip(reference, outputs, strict=True)):
        diff = next((j for j, (a, b) in enumerate(zip(want, got)) if a[0] != b[0]), None)
        if diff is None and len(want) == len(got):
            counts["identical"] += 1
        elif diff is not None and want[diff][1] is not None and want[diff][1] < tie_gap:
            counts["ties"] += 1
        else:
            mismatches.append({"request": i, "at": diff, "want": [t for t, _ in want],
                               "got": [t for t, _ in got]})
    return {**counts, "mismatches": len(mismatches), "first_mismatches": mismatches[:3]}


def run_check(name: str, model_dir: pathlib.Path, device: str, reference: list[list],
              tie_gap: float) -> dict:
    """One check's result: status pass / fail / report / skipped, its comparison and engine stats."""
    fields = CHECKS[name]
    if fields.get("attention_backend") == "triton" and importlib.util.find_spec("triton") is None:
        return {"status": "skipped", "reason": "triton is not installed"}
    outputs, stats, seconds = run(model_dir, device, fields)
    result = {"fields": fields, "time_s": round(seconds, 3), **compare(reference, outputs, tie_gap),
              "stats": {k: stats[k] for k in ("cache_hit_rate", "num_cached_tokens", "num_preemptions",
                                              "num_cached_tokens_host", "hicache_loads",
                                              "spec_num_verify_steps", "spec_num_accepted_tokens")
                        if k in stats}}
    if name in REPORT_ONLY:
        return {"status": "report", **result}
    problems = [f"{result['mismatches']} requests differ from the reference"] if result["mismatches"] else []
    if name in EXPECT and not stats.get(EXPECT[name][0]):
        problems.append(f"no {EXPECT[name][1]} ({EXPECT[name][0]} = 0)")
    return {"status": "fail" if problems else "pass", "problems": problems, **result}


def environment(device: str) -> dict:
    import torch
    info = {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if importlib.util.find_spec("triton") is not None:
        import triton
        info["triton"] = triton.__version__
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    p.add_argument("--model-dir", type=pathlib.Path, help="write (or reuse) the tiny model here")
    p.add_argument("--tie-gap", type=float, default=1e-3, help="top-2 logprob gap below which a difference is a tie")
    p.add_argument("--out", type=pathlib.Path, help="JSON of results (default: $OUT/engine_check.json when $OUT is set)")
    args = p.parse_args()
    names = [n for n in args.checks.split(",") if n]
    unknown = set(names) - set(CHECKS)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # read when the kernels are defined, on first use
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or pathlib.Path(tmp) / "tiny"
        if not (model_dir / "config.json").is_file():
            build_model(model_dir)
        reference, _, seconds = run(model_dir, "cpu", {"attention_backend": "torch"})
        report = {**environment(args.device), "num_requests": len(reference),
                  "reference": {"device": "cpu", "dtype": "float32", "time_s": round(seconds, 3)},
                  "checks": {}}
        for name in names:
            report["checks"][name] = result = run_check(name, model_dir, args.device, reference, args.tie_gap)
            print(f"{name:11s} {result['status']:7s} " + json.dumps(
                {k: result[k] for k in ("identical", "ties", "mismatches", "time_s", "problems", "reason")
                 if k in result}), flush=True)
    report["passed"] = all(r["status"] != "fail" for r in report["checks"].values())
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "engine_check.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    print("engine_check:", "all gated checks passed" if report["passed"] else "some check FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
