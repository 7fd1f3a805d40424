"""Benchmark output: run summaries, the sweep table and plot (knee marked), and the regression compare of two JSONL files."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

# metric -> True when higher is better
COMPARE_METRICS = {
    "request_throughput": True, "output_throughput": True, "total_throughput": True,
    "cache_hit_rate": True, "median_ttft_ms": False, "p99_ttft_ms": False,
    "median_tpot_ms": False, "p99_tpot_ms": False, "median_itl_ms": False,
    "median_e2e_latency_ms": False,
}
DEFAULT_COMPARE = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "cache_hit_rate")


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


SUMMARY_KEYS = [
    "completed", "failed", "duration", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "max_output_tokens_per_s", "max_concurrent_requests",
    "cache_hit_rate", "metrics_cache_hit_rate", "theory_reuse", "request_goodput", "slo_attainment",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p95_itl_ms", "p99_itl_ms", "max_itl_ms",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "std_e2e_latency_ms", "p90_e2e_latency_ms",
    "p99_e2e_latency_ms", "spec_accept_length", "spec_accept_rate", "median_spec_accept_length"]


def summary(record: dict) -> str:
    head = (f"== radixserve bench: {record.get('dataset_name')} backend={record.get('backend')} "
            f"rate={record.get('request_rate')} max_concurrency={record.get('max_concurrency')} "
            f"ignore_eos={record.get('ignore_eos')} ==")
    lines = [head]
    if "range_ratio_semantics" in record:
        lines.append(f"lengths: {record['range_ratio_semantics']}")
    lines += [f"{k:<32}{fmt(record[k])}" for k in SUMMARY_KEYS if k in record]
    return "\n".join(lines)


SWEEP_HEADERS = ("concurrency", "throughput tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "hit rate")


def sweep_rows(records: Sequence[dict]) -> list[list]:
    """Throughput is total (input + output) tokens per second."""
    return [[r["max_concurrency"], r["total_throughput"], r["median_ttft_ms"], r["p99_ttft_ms"],
             r["median_tpot_ms"], r.get("cache_hit_rate")] for r in records]


def knee_index(throughputs: Sequence[float], fraction: float = 0.9) -> int:
    """The first level whose throughput reaches `fraction` of the best."""
    best = max(throughputs)
    return next(i for i, t in enumerate(throughputs) if t >= fraction * best)


def plot_sweep(records: Sequence[dict], path: str) -> None:
    """PNG: throughput and TTFT p50/p99 against concurrency (log2), the knee marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in records]
    thr = [r["total_throughput"] for r in records]
    knee = knee_index(thr)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(conc, thr, "o-", color="tab:blue", label="throughput (tok/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("total throughput (tok/s)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(conc, [r["median_ttft_ms"] for r in records], "s--", color="tab:red", label="TTFT p50")
    ax2.plot(conc, [r["p99_ttft_ms"] for r in records], "^:", color="tab:red", label="TTFT p99")
    ax2.set_ylabel("TTFT (ms)", color="tab:red")
    ax.axvline(conc[knee], color="gray", linestyle="--")
    ax.annotate(f"knee: {conc[knee]}", (conc[knee], thr[knee]), textcoords="offset points",
                xytext=(6, -14))
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    ax.set_title(f"radixserve bench sweep ({records[0].get('dataset_name')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True, slots=True)
class Comparison:
    metric: str
    base: float | None
    new: float | None
    change: float | None  # relative, signed so that negative = worse
    regressed: bool


def compare_records(base: dict, new: dict, metrics: Sequence[str], max_regression: float) -> list[Comparison]:
    """Each metric's signed relative change (negative = worse); worse by over `max_regression` regresses."""
    out = []
    for metric in metrics:
        b, n = base.get(metric), new.get(metric)
        if b is None or n is None:
            out.append(Comparison(metric, b, n, None, False))
            continue
        if b == 0:
            change = 0.0 if n == 0 else (1.0 if COMPARE_METRICS.get(metric, True) == (n > 0) else -1.0)
        else:
            change = (n - b) / abs(b) * (1 if COMPARE_METRICS.get(metric, True) else -1)
        out.append(Comparison(metric, b, n, change, change < -max_regression))
    return out


def parse_fraction(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05."""
    text = text.strip()
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def compare_files(base_path: str, new_path: str, metrics: Sequence[str], max_regression: float) -> tuple[str, bool]:
    """Pair two JSONL files' runs line by line; returns the table and whether anything regressed."""
    base, new = read_jsonl(base_path), read_jsonl(new_path)
    if not base or not new:
        raise ValueError("both files need at least one run")
    rows, regressed = [], False
    for i, (b, n) in enumerate(zip(base, new)):
        label = b.get("tag") or f"run {i}"
        if b.get("max_concurrency") is not None:
            label += f" c={b['max_concurrency']}"
        for c in compare_records(b, n, metrics, max_regression):
            regressed |= c.regressed
            change = "-" if c.change is None else f"{c.change * 100:+.1f}%"
            rows.append([label, c.metric, c.base, c.new, change, "REGRESSED" if c.regressed else "ok"])
    text = table(("run", "metric", "base", "new", "change (+ = better)", "verdict"), rows)
    return text, regressed
