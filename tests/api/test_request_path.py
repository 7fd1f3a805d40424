"""benchmarks/request_path.py on one plain streamed completion: the path may not grow.

The limits are the counts measured when the restructure of issue 39 landed (docs/architecture.md);
that issue's targets are 24 modules and 10 types. Lower them as the path shrinks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.api.conftest import REPO

MAX_MODULES = 24
MAX_TYPES = 10


def trace(model_dir) -> dict[str, dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "benchmarks/request_path.py", "--json", "--model-path", str(model_dir)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plain_request_path_is_short(tiny_model_dir):
    found = trace(tiny_model_dir)
    # the tracer works: the request really crossed the HTTP side, the engine and the runner
    for module in ("server/completions.py", "engine/engine.py", "engine/scheduler.py", "runner/model_runner.py"):
        assert module in found["modules"], found["modules"]
    assert "sampling_params.SamplingParams" in found["types"], found["types"]
    modules, types = sorted(found["modules"]), sorted(found["types"])
    assert len(modules) <= MAX_MODULES, f"{len(modules)} modules on the plain path, at most {MAX_MODULES}: {modules}"
    assert len(types) <= MAX_TYPES, f"{len(types)} request/token types, at most {MAX_TYPES}: {types}"
