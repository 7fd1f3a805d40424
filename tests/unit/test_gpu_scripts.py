"""The GPU benchmark scripts run on CPU in the suite, so their code cannot rot unnoticed between H200 runs."""
from __future__ import annotations

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
