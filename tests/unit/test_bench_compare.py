"""`radixserve bench compare`: regression direction per metric, the bound, and the exit code."""
from __future__ import annotations

import json

import pytest

from radixserve.bench import report
from radixserve.bench.cli import main

BASE = {"tag": "base", "output_throughput": 100.0, "median_ttft_ms": 50.0, "median_tpot_ms": 10.0,
        "cache_hit_rate": 0.80}


def write(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("change, code", [
    ({}, 0),
    ({"output_throughput": 96.0}, 0),        # -4% within 5%
    ({"output_throughput": 94.0}, 1),        # -6%
    ({"median_ttft_ms": 52.0}, 0),           # +4% latency
    ({"median_ttft_ms": 53.0}, 1),           # +6% latency is a regression
    ({"median_ttft_ms": 20.0}, 0),           # faster is fine
    ({"cache_hit_rate": 0.40}, 1),           # the seed case: hit rate halved
    ({"output_throughput": 150.0}, 0),
])
def test_compare_exit_code(tmp_path, capsys, change, code):
    base = write(tmp_path / "base.jsonl", BASE)
    new = write(tmp_path / "new.jsonl", {**BASE, **change})
    assert main(["compare", base, new, "--max-regression", "5%"]) == code
    out = capsys.readouterr().out
    assert "output_throughput" in out and ("REGRESSED" in out) == bool(code)


def test_compare_chosen_metrics_and_sweeps(tmp_path):
    base = write(tmp_path / "b.jsonl", {**BASE, "max_concurrency": 1}, {**BASE, "max_concurrency": 8})
    new = write(tmp_path / "n.jsonl", {**BASE, "max_concurrency": 1},
                {**BASE, "max_concurrency": 8, "median_tpot_ms": 20.0})
    assert main(["compare", base, new]) == 1
    assert main(["compare", base, new, "--metrics", "output_throughput"]) == 0
    assert main(["compare", base, new, "--max-regression", "150%"]) == 0


def test_missing_metric_is_not_judged():
    rows = report.compare_records({"a": 1.0}, {"b": 2.0}, ["a"], 0.05)
    assert rows[0].change is None and not rows[0].regressed
    assert report.parse_fraction("5%") == pytest.approx(0.05)
    assert report.parse_fraction("0.1") == pytest.approx(0.1)


def test_knee_and_sweep_plot(tmp_path):
    assert report.knee_index([100, 300, 380, 400, 405]) == 2
    records = [{"max_concurrency": c, "total_throughput": t, "median_ttft_ms": 10.0 * c,
                "p99_ttft_ms": 20.0 * c, "median_tpot_ms": 5.0, "cache_hit_rate": 0.5,
                "dataset_name": "shared-prefix"} for c, t in [(1, 100.0), (4, 350.0), (16, 390.0)]]
    path = tmp_path / "sweep.png"
    report.plot_sweep(records, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.table(report.SWEEP_HEADERS, report.sweep_rows(records))
    assert text.count("\n") == 4 and "390.00" in text
