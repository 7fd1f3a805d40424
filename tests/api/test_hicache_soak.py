"""The host-tier corruption soak of benchmarks/hicache.py, scaled down for CI: 50 multi-turn requests on the tiny model at concurrency 4, every layer's load delayed U(0, 4) ms, a device pool far below the working set, each greedy output checked against a tier-off reference run (bench --check-output): 0 corrupted."""
from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_soak_scaled_down_finds_no_corrupted_output(tiny_model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("hicache_bench", REPO / "benchmarks" / "hicache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.soak(str(tiny_model_dir), num_prompts=50, concurrency=4, delay_ms=2.0,
                        jitter_ms=2.0, device_tokens=1024, tmp=tmp_path)
    assert report["compared"] >= 49, report
    assert report["corrupted"] == 0, report["first_corrupted"]
    assert report["hicache_loads"] > 0 and report["num_cached_tokens_host"] > 0, report
