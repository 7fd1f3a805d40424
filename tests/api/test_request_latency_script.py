"""benchmarks/request_latency.py runs end to end on the tiny model (a smoke run: its numbers are not checked)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.api.conftest import REPO


def test_request_latency_script_reports_every_path(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "benchmarks/request_latency.py", "--requests", "3", "--model-path",
                          str(tiny_model_dir), "--", "--num-threads", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("offline_p50_ms", "worker_p50_ms", "router_p50_ms", "health_p50_ms", "router_added_p50_ms"):
        assert key in result and result[key] == result[key], key   # present and not NaN
    assert result["requests"] == 3
