"""benchmarks/agent_soak.py scaled down (issue 16: no false alarms idle or busy).

The soak's own code on two tiny-model workers: the fleet idle under a supervising agent (6 s,
longer than the servers' 5 s keep-alive, so pooled connections do expire), then
serving clients with ±30 % step-latency noise on every worker, and no hang phase. The script
fails on any agent `/status` sample showing a worker `health_ok: false`, any finding, any
acting decision; here it must exit 0 with no failed request. The 10-minute run on the default
model, with the hang phase, is in docs/ops_agent.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from radixserve.bench.launch import free_ports
from tests.api.conftest import REPO


def test_idle_then_busy_fleet_raises_no_false_alarm(tiny_model_dir, tmp_path):
    base = free_ports(11)   # router, workers from +1, agent on +10
    done = subprocess.run(
        [sys.executable, "benchmarks/agent_soak.py", "--model-path", str(tiny_model_dir),
         "--num-workers", "2", "--idle-s", "4", "--noise-s", "3", "--sweep-interval-s", "2", "--concurrency", "2",
         "--skip-hang", "--base-port", str(base), "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status samples"] > 0
    assert summary["samples with health_ok false"] == []
    assert not any(summary["findings after idle + noise"].values())
    assert summary["noise_actions"] == 0
    failed, total = summary["noise_requests_failed_of"]
    assert total > 0 and failed == 0, summary
