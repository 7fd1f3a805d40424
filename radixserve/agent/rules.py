"""Findings: pure functions from recorded worker snapshots (oldest first) to findings with evidence.

Rates are counter differences over the last `window_sweeps` sweeps (a counter that went down means
a restart: no rate). Thresholds are RuleConfig flags; docs/ops_agent.md gives each one's source."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from radixserve.agent.config import RuleConfig
from radixserve.agent.observe import WorkerSnapshot

P = "radixserve:"
TTFT = (P + "time_to_first_token_seconds_sum", P + "time_to_first_token_seconds_count")
ITL = (P + "inter_token_latency_seconds_sum", P + "inter_token_latency_seconds_count")
QUEUE, KV_USAGE = P + "num_queue_reqs", P + "token_usage"
PREEMPTED, REQUESTS = P + "num_preempted_reqs_total", P + "num_requests_total"
PROMPT, CACHED = P + "prompt_tokens_total", P + "cached_tokens_total"
GENERATED, ANOMALIES = P + "generation_tokens_total", P + "num_anomalies_total"
RSS = "process_resident_memory_bytes"
MIB = 1024.0 * 1024.0
# Every Finding.kind a rule can return (the agent's metrics start each at 0).
FINDING_KINDS = ("unresponsive", "error_rate", "ttft_outlier", "itl_outlier", "queue_building",
                 "kv_pressure", "hit_rate_collapsed", "anomaly_rate", "memory_growth",
                 "fleet_hit_rate_collapsed", "fleet_ttft_spread", "gpu_unhealthy")

History = Sequence[WorkerSnapshot]


@dataclass(frozen=True)
class Finding:
    """A rule that fired: `kind`, the worker (None for fleet-level), the numbers behind it."""

    kind: str
    url: str | None
    text: str
    evidence: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "url": self.url, "text": self.text, "evidence": self.evidence}


def _value(snap: WorkerSnapshot, key: str) -> float | None:
    """A metric sample, or a router counter when `key` starts with 'router.'."""
    if key.startswith("router."):
        v = (snap.router or {}).get(key[7:])
        return float(v) if isinstance(v, (int, float)) else None
    return snap.metrics.get(key)


def _delta(a: WorkerSnapshot, b: WorkerSnapshot, key: str) -> float | None:
    va, vb = _value(a, key), _value(b, key)
    if va is None or vb is None or vb < va:
        return None
    return vb - va


def _window(hist: History, sweeps: int) -> History:
    return hist[-(sweeps + 1):]


def _window_delta(hist: History, key: str, sweeps: int) -> float | None:
    w = _window(hist, sweeps)
    return _delta(w[0], w[-1], key) if len(w) >= 2 else None


def window_mean(hist: History, pair: tuple[str, str], sweeps: int) -> tuple[float, float] | None:
    """(mean s, samples) of a histogram over the window: delta sum / delta count."""
    total, count = _window_delta(hist, pair[0], sweeps), _window_delta(hist, pair[1], sweeps)
    if total is None or not count:
        return None
    return total / count, count


def window_increase(hist: History, key: str, sweeps: int) -> float | None:
    """How much counter `key` grew over the window; None when it is missing or went down."""
    return _window_delta(hist, key, sweeps)


def window_hit_rate(hist: History, sweeps: int) -> tuple[float, float] | None:
    """(cached / prompt tokens, prompt tokens) over the window; None without prompt tokens."""
    w = _window(hist, sweeps)
    return _hit_rate(w[0], w[-1]) if len(w) >= 2 else None


def _hit_rate(a: WorkerSnapshot, b: WorkerSnapshot) -> tuple[float, float] | None:
    cached, prompt = _delta(a, b, CACHED), _delta(a, b, PROMPT)
    return None if cached is None or not prompt else (cached / prompt, prompt)


def answering(hist: History) -> bool:
    """The last sweep saw the worker alive: /health 200, or a timeout while /metrics shows new tokens
    (too busy is not hung: health flaps under load); an error status (503: engine dead) is final."""
    if not hist:
        return False
    last = hist[-1]
    if last.health_ok:
        return True
    if last.health_error and last.health_error.startswith("status"):
        return False
    return len(hist) >= 2 and bool(_delta(hist[-2], last, GENERATED))


def unresponsive(hist: History, cfg: RuleConfig) -> Finding | None:
    """Not `answering` on each of the last `unresponsive_sweeps` sweeps."""
    n = cfg.unresponsive_sweeps
    if len(hist) < n or any(answering(hist[:len(hist) - k]) for k in range(n)):
        return None
    errors = [s.health_error for s in hist[-n:]]
    return Finding("unresponsive", hist[-1].url, f"/health failed on the last {n} "
                   f"sweeps ({errors[-1]})", {"errors": errors})


def error_rate(hist: History, cfg: RuleConfig) -> Finding | None:
    """Failure share of the router's requests to the worker, above a minimum volume (Envoy
    failure_percentage); or its breaker not closed for `breaker_sweeps` sweeps with a failure in
    the history (Envoy consecutive_5xx: an open breaker sends only probes, too few for the share)."""
    reqs = _window_delta(hist, "router.num_requests", cfg.window_sweeps)
    fails = _window_delta(hist, "router.num_failures", cfg.window_sweeps)
    if reqs is None or fails is None:
        return None
    share = fails / reqs if reqs else 0.0
    breakers = [(s.router or {}).get("breaker") for s in hist[-cfg.breaker_sweeps:]]
    evidence = {"requests": reqs, "failures": fails, "share": round(share, 3),
                "breaker": breakers[-1]}
    if reqs >= cfg.error_min_requests and share >= cfg.error_share:
        return Finding("error_rate", hist[-1].url, f"{fails:.0f} of {reqs:.0f} requests failed "
                       f"in the window ({share:.0%})", evidence)
    held = len(breakers) == cfg.breaker_sweeps and None not in breakers and "closed" not in breakers
    if held and (_delta(hist[0], hist[-1], "router.num_failures") or 0.0) >= 1:
        total = (hist[-1].router or {}).get("num_failures")
        return Finding("error_rate", hist[-1].url, f"router breaker {breakers[-1]} for "
                       f"{len(breakers)} sweeps ({total} failures in all)",
                       evidence | {"failures_total": total})
    return None


def latency_outlier(url: str, fleet: dict[str, History], cfg: RuleConfig,
                    which: str) -> Finding | None:
    """`which` "ttft" | "itl": window mean above `latency_ratio` x the peers' median and an absolute floor (Envoy
    success-rate detector, on latency); a worker with far more requests is a hot spot (fleet_ttft_spread), not slow."""
    pair, min_samples, floor = ((TTFT, cfg.ttft_min_samples, cfg.ttft_min_abs_s) if which == "ttft"
                                else (ITL, cfg.itl_min_samples, cfg.itl_min_abs_s))
    means = {u: window_mean(h, pair, cfg.window_sweeps) for u, h in fleet.items()}
    mine = means.get(url)
    peers = [m[0] for u, m in means.items() if u != url and m and m[1] >= min_samples]
    if mine is None or mine[1] < min_samples or len(peers) < max(cfg.min_peers, 1):
        return None
    median = statistics.median(peers)
    if mine[0] <= cfg.latency_ratio * median or mine[0] - median < floor:
        return None
    reqs = {u: _window_delta(h, "router.num_requests", cfg.window_sweeps) for u, h in fleet.items()}
    peer_reqs = [r for u, r in reqs.items() if u != url and r is not None]
    if reqs.get(url) and peer_reqs and reqs[url] >= cfg.imbalance_ratio * max(
            statistics.median(peer_reqs), 1.0):
        return None
    return Finding(f"{which}_outlier", url, f"mean {which.upper()} {mine[0] * 1e3:.0f} ms over "
                   f"{mine[1]:.0f} samples vs peers' median {median * 1e3:.0f} ms",
                   {"mean_s": mine[0], "samples": mine[1], "peers_median_s": median,
                    "ratio": mine[0] / median if median else None})


def queue_building(hist: History, cfg: RuleConfig) -> Finding | None:
    """Queue non-decreasing over 4 sweeps to >= `queue_min` while tokens/s fell below `throughput_drop`x."""
    w = _window(hist, cfg.window_sweeps)
    queues = [s.metrics.get(QUEUE) for s in w]
    if len(w) < 5 or any(q is None for q in queues[-4:]):
        return None
    last = queues[-4:]
    if any(b < a for a, b in zip(last, last[1:])) or last[-1] < cfg.queue_min or last[-1] == last[0]:
        return None
    mid = len(w) // 2
    rates = []
    for a, b in ((w[0], w[mid]), (w[mid], w[-1])):
        tokens = _delta(a, b, GENERATED)
        rates.append(None if tokens is None or b.t <= a.t else tokens / (b.t - a.t))
    early, late = rates
    if not early or late is None or late >= cfg.throughput_drop * early:
        return None
    return Finding("queue_building", hist[-1].url, f"queue {last[0]:.0f} -> {last[-1]:.0f} while "
                   f"throughput fell {early:.1f} -> {late:.1f} tok/s",
                   {"queue": last, "tokens_per_s": [early, late]})


def kv_pressure(hist: History, cfg: RuleConfig) -> Finding | None:
    """KV usage at or above `kv_usage` on the last two sweeps and preemptions rising."""
    usage = [s.metrics.get(KV_USAGE) for s in hist[-2:]]
    if len(usage) < 2 or any(u is None or u < cfg.kv_usage for u in usage):
        return None
    preempted = _window_delta(hist, PREEMPTED, cfg.window_sweeps)
    if preempted is None or preempted < cfg.kv_min_preemptions:
        return None
    return Finding("kv_pressure", hist[-1].url, f"KV {usage[-1]:.0%} full, {preempted:.0f} "
                   "preemptions in the window", {"token_usage": usage, "preemptions": preempted})


def hit_rate_collapsed(hist: History, cfg: RuleConfig) -> Finding | None:
    """Window hit rate below `hit_collapse_ratio` x the worker's own older rate."""
    n = cfg.window_sweeps
    if len(hist) < n + 3:
        return None
    base, recent = _hit_rate(hist[0], hist[-n - 1]), _hit_rate(hist[-n - 1], hist[-1])
    if not _collapsed(base, recent, cfg):
        return None
    return Finding("hit_rate_collapsed", hist[-1].url, f"hit rate {recent[0]:.0%} vs "
                   f"{base[0]:.0%} before", {"baseline": base[0], "recent": recent[0]})


def _collapsed(base: tuple[float, float] | None, recent: tuple[float, float] | None,
               cfg: RuleConfig) -> bool:
    if base is None or recent is None or min(base[1], recent[1]) < cfg.hit_min_prompt_tokens:
        return False
    return base[0] >= cfg.hit_min_baseline and recent[0] < cfg.hit_collapse_ratio * base[0]


def anomaly_rate(hist: History, cfg: RuleConfig) -> Finding | None:
    """At least `anomaly_min` output anomalies in the window, and `anomaly_share` of the requests."""
    anomalies = _window_delta(hist, ANOMALIES, cfg.window_sweeps)
    if anomalies is None or anomalies < cfg.anomaly_min:
        return None
    reqs = _window_delta(hist, REQUESTS, cfg.window_sweeps) or 0.0
    share = anomalies / max(reqs, anomalies, 1.0)
    if share < cfg.anomaly_share:
        return None
    return Finding("anomaly_rate", hist[-1].url, f"{anomalies:.0f} output anomalies in "
                   f"{reqs:.0f} requests", {"anomalies": anomalies, "requests": reqs})


def memory_growth(hist: History, cfg: RuleConfig) -> Finding | None:
    """RSS growing over `memory_window_sweeps`: no dip over `memory_dip_mb` (GC sawtooth), a
    least-squares slope >= `memory_slope_mb_per_s` adding `memory_min_growth_mb`, and each of
    `memory_segments` parts growing at >= half that slope (a leak, not a one-time step)."""
    w = [(s.t, s.metrics[RSS]) for s in _window(hist, cfg.memory_window_sweeps) if RSS in s.metrics]
    if len(w) < cfg.memory_window_sweeps + 1:
        return None
    if any(b[1] < a[1] - cfg.memory_dip_mb * MIB for a, b in zip(w, w[1:])):
        return None
    ts, rss = [t for t, _ in w], [r for _, r in w]
    t_mean, r_mean = statistics.fmean(ts), statistics.fmean(rss)
    var = sum((t - t_mean) ** 2 for t in ts)
    slope = sum((t - t_mean) * (r - r_mean) for t, r in w) / var if var else 0.0
    growth = rss[-1] - rss[0]
    if slope < cfg.memory_slope_mb_per_s * MIB or growth < cfg.memory_min_growth_mb * MIB:
        return None
    rates = _segment_rates(w, cfg.memory_segments)
    if min(rates) < 0.5 * cfg.memory_slope_mb_per_s * MIB:
        return None
    return Finding("memory_growth", hist[-1].url, f"resident memory +{growth / MIB:.0f} MiB at "
                   f"{slope / MIB:.2f} MiB/s, growing in each part of the window",
                   {"growth_mb": growth / MIB, "slope_mb_per_s": slope / MIB,
                    "segment_mb_per_s": [round(r / MIB, 3) for r in rates]})


def _segment_rates(w: list[tuple[float, float]], parts: int) -> list[float]:
    """Growth rate (bytes/s) of each of `parts` equal parts of `w`, (t s, bytes) samples."""
    n = len(w) - 1
    parts = max(1, min(parts, n))
    cuts = [w[round(i * n / parts)] for i in range(parts + 1)]
    return [(rb - ra) / (tb - ta) if tb > ta else 0.0
            for (ta, ra), (tb, rb) in zip(cuts, cuts[1:])]


WORKER_RULES = (unresponsive, error_rate, queue_building, kv_pressure, hit_rate_collapsed,
                anomaly_rate, memory_growth)


def fleet_hit_rate_collapsed(fleet: dict[str, History], cfg: RuleConfig) -> Finding | None:
    """The fleet's hit rate collapsed while requests were even (max/min <= even_ratio): weak affinity."""
    n = cfg.window_sweeps
    hists = [h for h in fleet.values() if len(h) >= n + 3]
    if len(hists) < 2:
        return None
    sums = [[0.0, 0.0], [0.0, 0.0]]  # [baseline, recent] x [cached, prompt]
    for h in hists:
        for i, (a, b) in enumerate(((h[0], h[-n - 1]), (h[-n - 1], h[-1]))):
            cached, prompt = _delta(a, b, CACHED), _delta(a, b, PROMPT)
            if cached is None or prompt is None:
                return None
            sums[i][0] += cached
            sums[i][1] += prompt
    base, recent = [(c / p, p) if p else None for c, p in sums]
    reqs = [_window_delta(h, "router.num_requests", n) for h in hists]
    if not _collapsed(base, recent, cfg) or any(r is None or r < 1 for r in reqs):
        return None
    if max(reqs) > cfg.even_ratio * min(reqs):
        return None
    return Finding("fleet_hit_rate_collapsed", None, f"fleet hit rate {recent[0]:.0%} vs "
                   f"{base[0]:.0%} before, requests even", {"baseline": base[0],
                                                            "recent": recent[0], "requests": reqs})


def fleet_ttft_spread(fleet: dict[str, History], cfg: RuleConfig) -> Finding | None:
    """Slowest/fastest mean TTFT >= spread_ratio, the slowest with imbalance_ratio x the least requests: a hot spot."""
    means = {u: window_mean(h, TTFT, cfg.window_sweeps) for u, h in fleet.items()}
    means = {u: m for u, m in means.items() if m and m[1] >= cfg.ttft_min_samples}
    if len(means) < 2:
        return None
    slow, fast = max(means, key=lambda u: means[u][0]), min(means, key=lambda u: means[u][0])
    slowest, fastest = means[slow][0], means[fast][0]
    if slowest < cfg.spread_ratio * fastest or slowest - fastest < cfg.ttft_min_abs_s:
        return None
    reqs = {u: _window_delta(h, "router.num_requests", cfg.window_sweeps) or 0.0
            for u, h in fleet.items()}
    if reqs[slow] < cfg.imbalance_ratio * max(min(reqs.values()), 1.0):
        return None
    return Finding("fleet_ttft_spread", None, f"TTFT {means[slow][0] * 1e3:.0f} ms on {slow} "
                   f"(got {reqs[slow]:.0f} requests) vs {means[fast][0] * 1e3:.0f} ms on {fast}",
                   {"slowest": slow, "fastest": fast, "requests": reqs,
                    "ttft_s": {u: m[0] for u, m in means.items()}})


def gpu_unhealthy(gpus: list[dict] | None) -> list[Finding]:
    """NVML: uncorrected ECC errors, retired pages pending, a narrowed PCIe link (AIBrix diagnose)."""
    findings = []
    for g in gpus or ():
        problems = [p for p, bad in (
            ("uncorrected ECC errors", (g.get("ecc_uncorrected") or 0) > 0),
            ("retired pages pending", bool(g.get("retired_pages_pending"))),
            ("PCIe link degraded", None not in (g.get("pcie_width"), g.get("pcie_width_max"))
             and g["pcie_width"] < g["pcie_width_max"])) if bad]
        if problems:
            findings.append(Finding("gpu_unhealthy", None, f"GPU {g['index']}: "
                                    + ", ".join(problems), g))
    return findings


def evaluate(fleet: dict[str, History], cfg: RuleConfig,
             gpus: list[dict] | None = None) -> list[Finding]:
    findings: list[Finding] = []
    for url, hist in fleet.items():
        if not hist:
            continue
        findings += [f for rule in WORKER_RULES if (f := rule(hist, cfg))]
        findings += [f for which in ("ttft", "itl")
                     if (f := latency_outlier(url, fleet, cfg, which))]
    findings += [f for rule in (fleet_hit_rate_collapsed, fleet_ttft_spread)
                 if (f := rule(fleet, cfg))]
    return findings + gpu_unhealthy(gpus)


def probe_recovered(hist: History, cfg: RuleConfig) -> bool:
    """The last `recover_sweeps` probes each within `recover_ratio` x the peer's latency (hysteresis)."""
    probes = [s.probe for s in hist[-cfg.recover_sweeps:]]
    if len(probes) < cfg.recover_sweeps:
        return False
    return all(p is not None and p.latency_s is not None and p.peer_latency_s is not None
               and p.latency_s <= cfg.recover_ratio * p.peer_latency_s for p in probes)
