"""Agent rules as pure functions over recorded histories: each finding fires on its fault and stays quiet on noise."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from radixserve.agent import rules
from radixserve.agent.config import RuleConfig
from radixserve.agent.observe import Probe, WorkerSnapshot, parse_metrics
from tests.unit.agent_histories import Load, fleet, history

CFG = RuleConfig()
N = 36  # sweeps of history (the agent's default)


def kinds(findings):
    return sorted({(f.kind, f.url) for f in findings})


def fault_from(start: int, faulty: Load, normal: Load | None = None):
    return lambda k: faulty if k >= start else (normal or Load())


@pytest.mark.parametrize("seed", range(40))
def test_noise_alone_fires_nothing(seed):
    """+-30% jitter on every rate and latency, three workers, a full history: no finding."""
    assert rules.evaluate(fleet(3, N, seed=seed), CFG) == []


def test_noise_with_a_stray_failure_and_one_missed_health_check_fires_nothing():
    def stray(k):
        return Load(failures=1 if k % 7 == 0 else 0, health_ok=k != 30)
    assert rules.evaluate(fleet(3, N, special={1: stray}), CFG) == []


def test_unresponsive_fires_after_consecutive_failed_health_checks_only():
    def hung_for(n):
        return fleet(3, N, special={0: lambda k: Load(health_ok=k < N - n)})
    assert ("unresponsive", "http://w0") in kinds(rules.evaluate(hung_for(3), CFG))
    assert rules.evaluate(hung_for(2), CFG) == []
    f = rules.unresponsive(hung_for(4)["http://w0"], CFG)
    assert f.evidence["errors"] == ["timeout"] * 3


def test_a_busy_worker_is_not_unresponsive_but_a_dead_engine_is():
    """/health timing out while /metrics shows tokens still being generated: busy, not hung.
    /health 503 (engine dead) with /metrics answering a frozen snapshot: unresponsive."""
    busy = fleet(3, N, special={0: lambda k: Load(health_ok=k < N - 5, metrics_answer=True)})
    assert rules.evaluate(busy, CFG) == []
    assert rules.answering(busy["http://w0"])

    def dead(k):
        return Load(health_ok=False, health_error="status 503", metrics_answer=True,
                    requests=0) if k >= N - 3 else Load()
    found = rules.evaluate(fleet(3, N, special={0: dead}), CFG)
    assert ("unresponsive", "http://w0") in kinds(found)


def test_error_rate_needs_a_share_and_a_volume():
    failing = fleet(3, N, special={0: fault_from(N - 6, Load(failures=15))})
    found = rules.evaluate(failing, CFG)
    assert kinds(found) == [("error_rate", "http://w0")]
    assert found[0].evidence["failures"] == 90
    trickle = fleet(3, N, special={0: lambda k: Load(requests=1, failures=1)})
    assert rules.evaluate(trickle, CFG) == []   # 100% but 6 requests: below the volume


def test_error_rate_fires_on_a_breaker_held_open():
    """Once the router's breaker opens the worker gets only probes: the volume rule cannot
    see it, the breaker can."""
    def broke(open_from):
        return [Load(requests=0.4, failures=1 if k == open_from else 0,
                     breaker="half_open" if k % 2 else "open") if k >= open_from else Load()
                for k in range(N)]
    f = rules.error_rate(history("http://w0", broke(N - 3)), CFG)
    assert f.kind == "error_rate" and "breaker" in f.text
    assert rules.error_rate(history("http://w0", broke(N - 2)), CFG) is None   # 2 sweeps only
    closed_again = broke(N - 6)[:-1] + [Load(requests=0.4)]
    assert rules.error_rate(history("http://w0", closed_again), CFG) is None
    no_new_failure = history("http://w0", broke(N - 6))[-5:]   # history reset on return
    assert rules.error_rate(no_new_failure, CFG) is None


@pytest.mark.parametrize("which,slow", [("ttft", Load(ttft_s=0.5, requests=12)),
                                        ("itl", Load(itl_s=0.08, requests=12))])
def test_latency_outlier_against_the_fleet_median(which, slow):
    found = rules.evaluate(fleet(3, N, special={2: fault_from(N - 6, slow)}), CFG)
    assert (f"{which}_outlier", "http://w2") in kinds(found)
    assert all(f.url == "http://w2" for f in found)
    f = next(f for f in found if f.kind == f"{which}_outlier")
    assert f.evidence["ratio"] > CFG.latency_ratio


def test_latency_outlier_is_relative_not_a_fixed_number():
    """The whole fleet slow together (a long-prompt workload) is not an outlier."""
    every = {i: (lambda k: Load(ttft_s=2.0, itl_s=0.1)) for i in range(3)}
    assert rules.evaluate(fleet(3, N, special=every), CFG) == []
    twice = fleet(3, N, special={0: lambda k: Load(ttft_s=0.1, itl_s=0.02)})
    assert rules.evaluate(twice, CFG) == []   # 2x the others: under the 3x ratio


def test_latency_outlier_needs_samples_and_peers():
    rare = fleet(3, N, special={0: lambda k: Load(ttft_s=1.0, requests=0.4, itl_s=0.01)})
    assert rules.evaluate(rare, CFG) == []
    pair = fleet(2, N, special={0: lambda k: Load(ttft_s=1.0)})
    assert [f for f in rules.evaluate(pair, CFG) if f.kind.endswith("_outlier")] == []


def test_hot_spot_is_a_fleet_ttft_spread_not_a_slow_worker():
    hot = fleet(3, N, special={0: fault_from(N - 6, Load(requests=60, ttft_s=0.6))})
    assert kinds(rules.evaluate(hot, CFG)) == [("fleet_ttft_spread", None)]


def test_queue_building_while_throughput_falls():
    def jam(k):
        if k < N - 4:
            return Load()
        return Load(requests=3, queue=[8, 12, 17, 23][k - (N - 4)])
    found = rules.queue_building(history("http://w0", [jam(k) for k in range(N)]), CFG)
    assert found is not None and found.evidence["queue"] == [8, 12, 17, 23]

    def busy(k):  # queue grows but throughput holds: a burst, not a jam
        return Load(queue=[8, 12, 17, 23][k - (N - 4)]) if k >= N - 4 else Load()
    assert rules.queue_building(history("http://w0", [busy(k) for k in range(N)]), CFG) is None


def test_kv_pressure_needs_full_kv_and_rising_preemptions():
    full = [Load(token_usage=0.97, preemptions=1 if k >= N - 4 else 0) for k in range(N)]
    assert rules.kv_pressure(history("http://w0", full), CFG).kind == "kv_pressure"
    no_preempt = [Load(token_usage=0.97) for _ in range(N)]
    assert rules.kv_pressure(history("http://w0", no_preempt), CFG) is None


def test_hit_rate_collapsed_against_its_own_history():
    drop = fleet(3, N, special={1: fault_from(N - 6, Load(hit_rate=0.05))})
    assert kinds(rules.evaluate(drop, CFG)) == [("hit_rate_collapsed", "http://w1")]
    low_always = fleet(3, N, special={1: lambda k: Load(hit_rate=0.05)})
    assert rules.evaluate(low_always, CFG) == []


def test_fleet_hit_rate_collapsed_while_load_even():
    every = {i: fault_from(N - 6, Load(hit_rate=0.05)) for i in range(3)}
    found = kinds(rules.evaluate(fleet(3, N, special=every), CFG))
    assert ("fleet_hit_rate_collapsed", None) in found


def test_anomaly_rate():
    bad = fleet(3, N, special={0: fault_from(N - 3, Load(anomalies=4))})
    assert kinds(rules.evaluate(bad, CFG)) == [("anomaly_rate", "http://w0")]
    one = fleet(3, N, special={0: lambda k: Load(anomalies=1 if k == N - 2 else 0)})
    assert rules.evaluate(one, CFG) == []


def test_memory_growing_without_bound():
    leak = fleet(3, N, special={0: lambda k: Load(rss_mb=300 + 5 * k)})  # 1 MiB/s
    found = rules.evaluate(leak, CFG)
    assert kinds(found) == [("memory_growth", "http://w0")]
    assert found[0].evidence["slope_mb_per_s"] == pytest.approx(1.0, rel=0.2)
    sawtooth = fleet(3, N, special={0: lambda k: Load(rss_mb=300 + 20 * (k % 5))})  # GC drops
    assert rules.evaluate(sawtooth, CFG) == []
    slow = fleet(3, N, special={0: lambda k: Load(rss_mb=300 + 0.5 * k)})  # 0.1 MiB/s
    assert rules.evaluate(slow, CFG) == []


def test_a_one_time_memory_step_is_not_a_leak():
    # One rejected 10 MB request: RSS 386 -> 1038 MiB once, then flat (QA run); at every
    # position of the step in the window and on several noise seeds
    for seed in range(5):
        for at in range(N):
            step = history("http://w0", [Load(rss_mb=386 if k < at else 1038) for k in range(N)],
                           seed=seed)
            for end in range(1, N + 1):
                assert rules.memory_growth(step[:end], CFG) is None, (seed, at, end)
    two = history("http://w0", [Load(rss_mb=300 + 200 * (k >= 25) + 200 * (k >= 29))
                                for k in range(N)])
    assert rules.memory_growth(two, CFG) is None    # two big requests are not a leak either


def test_memory_growing_in_steps_or_slowly_is_a_leak():
    for every in (2, 3, 4):      # a staircase: +40 MiB each `every` sweeps, never flat for long
        stairs = history("http://w0", [Load(rss_mb=300 + 40 * (k // every)) for k in range(N)])
        found = rules.memory_growth(stairs, CFG)
        assert found is not None and min(found.evidence["segment_mb_per_s"]) > 0, every
    for seed in range(10):       # just above the slope threshold (0.6 MiB/s), with noise
        slow = history("http://w0", [Load(rss_mb=300 + 3 * k) for k in range(N)], seed=seed)
        assert rules.memory_growth(slow, CFG) is not None, seed
    stopped = history("http://w0", [Load(rss_mb=300 + 5 * min(k, N - 5)) for k in range(N)])
    assert rules.memory_growth(stopped, CFG) is None   # it grew, but no longer does


def test_a_restart_resets_counters_without_a_false_finding():
    hist = fleet(3, N)
    w0 = hist["http://w0"]
    restarted = [dataclasses.replace(s, metrics={k: v * 0.01 for k, v in s.metrics.items()})
                 for s in w0[-3:]]
    hist["http://w0"] = w0[:-3] + restarted
    assert [f for f in rules.evaluate(hist, CFG) if f.kind != "memory_growth"] == []


def test_gpu_unhealthy():
    clean = {"index": 0, "ecc_uncorrected": 0, "retired_pages_pending": 0, "pcie_width": 16,
             "pcie_width_max": 16}
    assert rules.gpu_unhealthy([clean]) == []
    assert rules.gpu_unhealthy(None) == []
    bad = rules.gpu_unhealthy([clean | {"ecc_uncorrected": 2, "pcie_width": 8}])
    assert len(bad) == 1 and "ECC" in bad[0].text and "PCIe" in bad[0].text


def test_probe_recovered_needs_consecutive_good_probes():
    def snaps(ratios):
        return [WorkerSnapshot("http://w0", i, True, probe=Probe(r, "http://w1", 1.0)
                               if r is not None else None) for i, r in enumerate(ratios)]
    assert rules.probe_recovered(snaps([5.0, 1.2, 0.9, 1.4]), CFG)
    assert not rules.probe_recovered(snaps([1.0, 1.0, 2.0]), CFG)   # above recover_ratio
    assert not rules.probe_recovered(snaps([1.0, None, 1.0]), CFG)
    assert not rules.probe_recovered(snaps([1.0, 1.0]), CFG)


def test_parse_metrics_sums_label_sets_and_drops_buckets():
    text = ('# TYPE radixserve:num_anomalies counter\n'
            'radixserve:num_anomalies_total{kind="repetition"} 2.0\n'
            'radixserve:num_anomalies_total{kind="garbled"} 3.0\n'
            '# TYPE radixserve:ttft histogram\n'
            'radixserve:ttft_bucket{le="1.0"} 4.0\nradixserve:ttft_bucket{le="+Inf"} 5.0\n'
            'radixserve:ttft_count 5.0\nradixserve:ttft_sum 1.5\n')
    assert parse_metrics(text) == {"radixserve:num_anomalies_total": 5.0,
                                   "radixserve:ttft_count": 5.0, "radixserve:ttft_sum": 1.5}


def test_nvml_readings_feed_the_gpu_rule(monkeypatch):
    """read_nvml through a stand-in pynvml (no GPU here): one healthy GPU, one with
    uncorrected ECC errors and an unsupported query; without pynvml: skipped, with a note."""
    from radixserve.agent.gpu import read_nvml

    class NVMLError(Exception):
        pass

    def unsupported(handle):
        raise NVMLError("not supported")

    fake = types.SimpleNamespace(
        NVMLError=NVMLError, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "H200",
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 3 * h,
        nvmlDeviceGetRetiredPagesPendingStatus=unsupported,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetTemperature=lambda h, sensor: 40)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    readings, note = read_nvml()
    assert note == "2 GPU(s) read through NVML"
    assert readings[1]["ecc_uncorrected"] == 3 and readings[1]["retired_pages_pending"] is None
    found = rules.gpu_unhealthy(readings)
    assert [f.evidence["index"] for f in found] == [1]
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import fails
    assert read_nvml() == (None, "GPU checks skipped: nvidia-ml-py (pynvml) is not installed")
