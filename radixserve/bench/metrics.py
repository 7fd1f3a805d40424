"""Benchmark metric math (SGLang bench_serving semantics): per-request results in, one flat dict of run metrics out."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestResult:
    """One request as the client measured it, times in s: start_s at send (client queueing excluded), ttft_s to the
    first non-empty chunk, itl_s between non-empty chunks, latency_s to the stream's end; output_len is the server's
    completion_tokens, else the requested length (SGLang's fallback); usage and spec_* fields None if not sent."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    start_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    spec_verify_steps: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    generated_text: str = ""
    output_len_retokenized: int = 0
    error: str = ""
    index: int = -1
    tokens: list[str] = field(default_factory=list)
    top2_gaps: list[float | None] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request service-level objectives in ms; None = not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft_ms=500,tpot_ms=50[,e2e_ms=...]` -> Slo. Raises ValueError on unknown keys."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("ttft_ms", "tpot_ms", "e2e_ms") or not value:
                raise ValueError(f"bad SLO {part!r}: use ttft_ms=..,tpot_ms=..,e2e_ms=..")
            values[key] = float(value)
        return cls(**values)


def tpot_s(r: RequestResult) -> float | None:
    """(latency - ttft) / (n - 1); None when n <= 1."""
    if r.output_len <= 1:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_len - 1)


def stats_ms(values_s: list[float], name: str, percentiles: tuple[int, ...]) -> dict[str, float]:
    """mean/median/std/p{P} of `values_s` in ms under SGLang's key names; zeros when empty, as SGLang."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def is_good(r: RequestResult, slo: Slo) -> bool:
    """A completed request meets every given SLO (a 1-token output's TPOT counts as 0, as in vLLM)."""
    tpot = tpot_s(r) or 0.0
    return (r.success
            and (slo.ttft_ms is None or r.ttft_s * 1000 <= slo.ttft_ms)
            and (slo.tpot_ms is None or tpot * 1000 <= slo.tpot_ms)
            and (slo.e2e_ms is None or r.latency_s * 1000 <= slo.e2e_ms))


def token_times(r: RequestResult) -> list[float]:
    if not r.success:
        return []
    first = r.start_s + r.ttft_s
    return [first, *(first + float(c) for c in np.cumsum(r.itl_s))]


def max_output_tokens_per_s(results: list[RequestResult], t0: float) -> float:
    """Most streamed chunks landing in one 1-second bucket [t0 + k, t0 + k + 1)."""
    buckets: dict[int, int] = {}
    for r in results:
        for t in token_times(r):
            k = math.floor(t - t0)
            buckets[k] = buckets.get(k, 0) + 1
    return float(max(buckets.values(), default=0))


def max_concurrent_requests(results: list[RequestResult]) -> int:
    """Exact peak number of requests in flight (sweep line over [start, start + latency))."""
    events = []
    for r in results:
        if r.latency_s > 0:
            events += [(r.start_s, 1), (r.start_s + r.latency_s, -1)]
    peak = level = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at ties
        level += delta
        peak = max(peak, level)
    return peak


def compute_metrics(results: list[RequestResult], duration_s: float, t0: float = 0.0,
                    slo: Slo | None = None) -> dict[str, float | int | None]:
    """Run metrics (SGLang bench_serving definitions); failed requests add no tokens or latencies.
    `t0`: perf_counter() at first dispatch; cache_hit_rate = sum(cached) / sum(prompt_tokens)."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    total_retok = sum(r.output_len_retokenized for r in ok)
    duration = max(duration_s, 1e-9)
    m: dict[str, float | int | None] = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "total_output_tokens_retokenized": total_retok,
        "request_throughput": len(ok) / duration, "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "output_throughput_retokenized": total_retok / duration,
        "total_throughput": (total_input + total_output) / duration,
    }
    m.update(stats_ms([r.ttft_s for r in ok], "ttft", (90, 99)))
    m.update(stats_ms([t for r in ok if (t := tpot_s(r)) is not None], "tpot", (90, 99)))
    m.update(stats_ms([g for r in ok for g in r.itl_s], "itl", (90, 95, 99)))
    m["max_itl_ms"] = max((g * 1000 for r in ok for g in r.itl_s), default=0.0)
    m.update(stats_ms([r.latency_s for r in ok], "e2e_latency", (90, 99)))
    m["concurrency"] = sum(r.latency_s for r in ok) / duration  # Little's law
    m["max_output_tokens_per_s"] = max_output_tokens_per_s(ok, t0)
    m["max_concurrent_requests"] = max_concurrent_requests(ok)
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    m["server_prompt_tokens"] = prompt_tokens if with_usage else None
    m["cached_tokens"] = cached if with_usage else None
    m["cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else None
    m.update(spec_metrics(ok))
    if slo is not None:
        good = sum(is_good(r, slo) for r in results)
        m["request_goodput"] = good / duration
        m["slo_attainment"] = good / len(results) if results else 0.0
    return m


def spec_metrics(ok: list[RequestResult]) -> dict[str, float | int | None]:
    """Acceptance over requests that verified drafts: (accepted + steps) / steps, accepted / drafted."""
    spec = [r for r in ok if r.spec_verify_steps]
    steps = sum(r.spec_verify_steps or 0 for r in spec)
    drafted = sum(r.spec_draft_tokens or 0 for r in spec)
    accepted = sum(r.spec_accepted_tokens or 0 for r in spec)
    lengths = sorted(((r.spec_accepted_tokens or 0) + r.spec_verify_steps) / r.spec_verify_steps
                     for r in spec)
    return {"spec_requests": len(spec) if spec else None,
            "spec_accept_length": (accepted + steps) / steps if steps else None,
            "spec_accept_rate": accepted / drafted if drafted else None,
            "median_spec_accept_length": lengths[len(lengths) // 2] if lengths else None}
