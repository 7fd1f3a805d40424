"""Ops agent settings: rule thresholds, ladder timings and the loop's own flags, each with its source.

Every field is a `radixserve agent` flag; defaults start from Envoy outlier detection and SGLang's health checks."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import opt


@dataclass(frozen=True)
class RuleConfig:
    """Thresholds of the findings in rules.py (windows are counted in sweeps)."""

    window_sweeps: int = opt(6, "sweeps in the rate window of every counter-based rule "
                                "(30 s at the default sweep; Envoy interval 10 s)")
    unresponsive_sweeps: int = opt(3, "consecutive sweeps with /health failing or timing out "
                                      "(SGLang/Kubernetes: 3 failed probes)")
    error_min_requests: int = opt(10, "requests routed to a worker in the window before its "
                                      "failure share counts (Envoy request_volume 50; a small "
                                      "fleet sees fewer)")
    error_share: float = opt(0.5, "failure share (5xx and transport errors, as the router "
                                  "counts them) that fires (Envoy failure_percentage 85 "
                                  "percent; lower "
                                  "because each retried failure already costs latency)")
    breaker_sweeps: int = opt(3, "sweeps in a row the router's breaker for a worker is open or "
                                 "half-open before that alone fires (the router opens it after "
                                 "--cb-failure-threshold consecutive failures: Envoy "
                                 "consecutive_5xx)")
    latency_ratio: float = opt(3.0, "a worker's mean TTFT or ITL in the window above this x "
                                    "the median of the other workers' is an outlier")
    ttft_min_abs_s: float = opt(0.05, "and above the peers' median by at least this (s), so "
                                      "microsecond noise on an idle fleet never fires")
    itl_min_abs_s: float = opt(0.01, "the same floor for inter-token latency (s)")
    ttft_min_samples: int = opt(5, "first tokens a worker must have served in the window "
                                   "(Envoy: a minimum request volume before statistics)")
    itl_min_samples: int = opt(20, "inter-token intervals a worker must have in the window")
    min_peers: int = opt(2, "other workers with enough samples to compare against "
                            "(Envoy success_rate_minimum_hosts 5; ours are 3-worker fleets)")
    recover_ratio: float = opt(1.5, "a drained slow worker's probe within this x a routable "
                                    "peer's probe counts as recovered (hysteresis: < latency_ratio)")
    recover_sweeps: int = opt(3, "consecutive recovered probes before a slow worker returns")
    queue_min: int = opt(8, "queued requests at least this many, and growing over the window")
    throughput_drop: float = opt(0.7, "generated tokens/s in the window's second half below "
                                      "this x the first half")
    kv_usage: float = opt(0.95, "token_usage at or above this on the last two sweeps ...")
    kv_min_preemptions: int = opt(2, "... and at least this many preemptions in the window")
    hit_min_prompt_tokens: int = opt(2000, "prompt tokens in each of the baseline and the recent "
                                           "window before a hit rate counts")
    hit_min_baseline: float = opt(0.3, "a baseline hit rate below this cannot collapse")
    hit_collapse_ratio: float = opt(0.4, "recent hit rate below this x the baseline is a collapse")
    anomaly_min: int = opt(3, "output anomalies in the window ...")
    anomaly_share: float = opt(0.05, "... that are at least this share of its requests")
    memory_window_sweeps: int = opt(12, "sweeps of resident memory to fit a slope over")
    memory_slope_mb_per_s: float = opt(0.5, "growth faster than this (MiB/s, least squares) ...")
    memory_min_growth_mb: float = opt(32.0, "... adding at least this much (MiB) over the window")
    memory_dip_mb: float = opt(2.0, "a fall larger than this (MiB) between sweeps breaks the "
                                    "monotone growth")
    memory_segments: int = opt(3, "the memory window is cut into this many consecutive parts and "
                                  "each, the most recent included, must grow at half the slope "
                                  "threshold or more: a leak keeps growing, a one-time step (one "
                                  "large request) does not")
    spread_ratio: float = opt(3.0, "fleet: slowest / fastest worker mean TTFT at or above this ...")
    imbalance_ratio: float = opt(2.0, "... while the slowest worker got this x the requests of "
                                      "the least-used one: affinity made a hot spot")
    even_ratio: float = opt(1.5, "fleet: requests per worker within this max/min ratio is 'load "
                                 "even' for the hit-rate collapse rule")


@dataclass(frozen=True)
class LadderConfig:
    """Timings and limits of the per-worker ladder in ladder.py (Envoy outlier detection)."""

    confirm_sweeps: int = opt(2, "sweeps a finding must hold before the agent acts")
    clear_sweeps: int = opt(2, "quiet sweeps before a suspect is cleared (hysteresis)")
    reintegrate_sweeps: int = opt(3, "quiet sweeps after a return before a worker counts as "
                                     "healthy again (a finding in that time re-ejects it longer)")
    base_ejection_s: float = opt(30.0, "time out of rotation after an isolation, x the number "
                                       "of ejections (Envoy base_ejection_time 30 s); a restarted "
                                       "worker returns once healthy, a repeat offender after "
                                       "(n-1) x this")
    max_ejection_s: float = opt(300.0, "cap on the escalated ejection time (Envoy 300 s); also "
                                       "the quiet time after which one ejection is forgiven")
    max_ejection_share: float = opt(0.1, "most of the fleet out of rotation at once, at least "
                                         "one worker (Envoy max_ejection_percent 10 percent)")
    panic_share: float = opt(0.5, "below this share of workers answering /health the agent "
                                  "stops acting and alerts (Envoy healthy_panic_threshold "
                                  "50 percent)")
    drain_timeout_s: float = opt(10.0, "most time a hung worker is drained before its restart "
                                       "(its in-flight requests may never finish)")
    restart_timeout_s: float = opt(300.0, "a restarted worker not healthy by then raises an "
                                          "alert and is restarted again")
    max_actions_per_sweep: int = opt(1, "new drains, isolations and restarts per sweep, so one "
                                        "bad sweep cannot cascade")
    policy_cooldown_s: float = opt(60.0, "least time between two routing-policy changes")
    cache_threshold_step: float = opt(0.1, "change of the router's cache_threshold per step")
    cache_threshold_min: float = opt(0.1, "lowest cache_threshold the agent sets")
    cache_threshold_max: float = opt(0.9, "highest cache_threshold the agent sets")


@dataclass(frozen=True)
class AgentConfig:
    """The loop, its HTTP endpoint and its inputs (the router is given as --router)."""

    admin_api_key: str | None = opt(None, "the router's admin key")
    supervise: bool = opt(False, "restart hung or leaking workers from the fleet manifest "
                                 "(otherwise they are isolated)")
    fleet_manifest: str | None = opt(None, "JSON written by `radixserve fleet` (url, pid, argv, "
                                           "log of each worker); needed by --supervise")
    dry_run: bool = opt(False, "decide and log, never act")
    decision_log: str | None = opt(None, "JSONL file every decision is appended to")
    host: str = opt("127.0.0.1", "address of the agent's /metrics and /status")
    port: int = opt(30090, "port of the agent's /metrics and /status")
    sweep_interval_s: float = opt(5.0, "seconds between sweeps (Envoy interval: 10 s)")
    kill_grace_s: float = opt(5.0, "a restart sends SIGTERM, then SIGKILL after this (s): a "
                                   "hung worker may never finish a graceful stop")
    request_timeout_s: float = opt(5.0, "timeout of each health, metrics and info read (s; "
                                        "SGLang's health check: 5); a hung worker costs one "
                                        "timeout per sweep")
    probe_timeout_s: float = opt(10.0, "timeout of a recovery probe request (s); a sweep waits "
                                       "for its probes")
    probe_max_tokens: int = opt(16, "tokens a recovery probe generates")
    history_sweeps: int = opt(36, "snapshots kept per worker")
    worker_api_key: str | None = opt(None, "key sent to workers (/get_server_info, probes)")
    log_level: str = opt("info", "logging level", ("debug", "info", "warning", "error"))
    heartbeat_sweeps: int = opt(12, "a quiet fleet is logged once every this many sweeps")
