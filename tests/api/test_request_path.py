"""benchmarks/request_path.py on one plain streamed completion: at most 24 modules and 10 request/token
types (issue 39's targets; this fails until the restructure lands, and is never skipped)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.api.conftest import REPO


def trace(model_dir) -> dict[str, dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "benchmarks/request_path.py", "--json", "--model-path", str(model_dir)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plain_request_path_is_short(tiny_model_dir):
    found = trace(tiny_model_dir)
    # the tracer works: the request really crossed the HTTP side, the engine and the runner
    for module in ("server/app.py", "engine/engine.py", "engine/scheduler.py", "runner/model_runner.py"):
        assert module in found["modules"], found["modules"]
    assert "sampling_params.SamplingParams" in found["types"], found["types"]
    modules, types = sorted(found["modules"]), sorted(found["types"])
    assert len(modules) <= 24, f"issue 39 target: {len(modules)} modules on the plain path, at most 24: {modules}"
    assert len(types) <= 10, f"issue 39 target: {len(types)} request/token types, at most 10: {types}"
