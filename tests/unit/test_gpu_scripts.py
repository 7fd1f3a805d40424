"""The GPU benchmark scripts run on CPU in the suite, so their code cannot rot unnoticed between H200 runs."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_throughput_script_runs_tiny_on_cpu():
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "benchmarks/gpu/throughput.py", "--device", "cpu", "--tiny",
                          "--backends", "torch"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("tiny")]
    phases = {(row[2], int(row[3])) for row in rows if len(row) > 4}
    assert ("prefill", 2) in phases and {("decode", 1), ("decode", 4)} <= phases, out.stdout


def test_engine_check_runs_on_cpu(tmp_path):
    """benchmarks/gpu/engine_check.py's gated checks (triton and the report-only ones left out: slow on CPU)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "engine_check.json"
    run = subprocess.run([sys.executable, "benchmarks/gpu/engine_check.py", "--device", "cpu", "--out", str(out),
                          "--checks", "default,torch,ngram,host_tier,small_pool"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["num_requests"] == 24
    assert {name: r["status"] for name, r in report["checks"].items()} == dict.fromkeys(
        ("default", "torch", "ngram", "host_tier", "small_pool"), "pass")
    assert all(r["identical"] + r["ties"] == 24 for r in report["checks"].values())
    assert report["checks"]["small_pool"]["stats"]["num_preemptions"] > 0


def test_serve_check_runs_on_cpu(tmp_path):
    """benchmarks/gpu/serve_check.py: two CPU workers, greedy outputs equal over HTTP, a 2-level sweep."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OUT", None)
    out = tmp_path / "serve_check.json"
    run = subprocess.run([sys.executable, "benchmarks/gpu/serve_check.py", "--device", "cpu", "--out", str(out),
                          "--model-dir", str(tmp_path / "tiny"), "--concurrency", "1,4", "--sweep-prompts", "8"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["check_output"]["identical"] + report["check_output"]["tie"] == 24
    assert [r["max_concurrency"] for r in report["sweep"]] == [1, 4]
