"""install.sh says what it is doing: one line before each of its pip steps, then what to run next."""
from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_install_prints_one_line_per_step(tmp_path):
    stub = tmp_path / "bin" / "python"   # stands in for pip: prints its arguments, installs nothing
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "python $*"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(REPO / "install.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line[:len("install.sh: [1/5]")] for line in lines[0:10:2]] == [
        f"install.sh: [{i}/5]" for i in range(1, 6)]
    assert all(line.startswith("python -m pip install") for line in lines[1:10:2]), lines
    assert len(lines) == 11 and lines[-1].startswith("install.sh: done. Next: radixserve serve")
