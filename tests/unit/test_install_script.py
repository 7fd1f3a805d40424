"""install.sh says what it is doing: one line before each of its steps, then what to run next; its last step finds a
C++ compiler for --compile, installs Debian's g++ as root on Debian, else leaves a note; then builds radixserve/csrc."""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_install(bin_dir: pathlib.Path, path: str, **env: str) -> list[str]:
    """install.sh with `bin_dir/python` standing in for pip (prints its arguments, installs nothing), no $CXX
    unless `env` sets it."""
    stub = bin_dir / "python"
    stub.write_text('#!/bin/sh\necho "python $*"\n')
    stub.chmod(0o755)
    done = subprocess.run(["/bin/bash", str(REPO / "install.sh")], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "CXX"}, "PATH": path, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def stub(folder: pathlib.Path, name: str, body: str) -> None:
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def test_install_prints_one_line_per_step(tmp_path):
    (tmp_path / "bin").mkdir()
    lines = run_install(tmp_path / "bin", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", CXX="sh")
    assert [line[:len("install.sh: [1/7]")] for line in lines[0:10:2]] == [
        f"install.sh: [{i}/7]" for i in range(1, 6)]
    assert all(line.startswith("python -m pip install") for line in lines[1:10:2]), lines
    assert lines[10].startswith("install.sh: [6/7] a C++ compiler")
    assert lines[11].startswith("install.sh: C++ compiler: /") and lines[11].endswith("/sh"), lines[11]
    assert lines[12].startswith("install.sh: [7/7] radixserve's C++ kernels")
    assert lines[13:15] == ["python -m pip install --quiet ninja==1.13.0", "python -m radixserve.csrc.build"]
    assert len(lines) == 16 and lines[-1].startswith("install.sh: done. Next: radixserve serve")


@pytest.mark.parametrize("uid", ["0", "1000"])
def test_no_compiler_installs_debian_gxx_as_root_else_notes(tmp_path, uid):
    """A PATH of stubs and the few tools install.sh uses, so g++ is missing whatever this machine has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "tail", "rm"):
        (bin_dir / tool).symlink_to(next(p for d in ("/usr/bin", "/bin") if (p := pathlib.Path(d, tool)).exists()))
    stub(bin_dir, "id", f"echo {uid}")
    stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {tmp_path / "apt.log"}')
    lines = run_install(bin_dir, str(bin_dir))
    compiler = lines[lines.index("install.sh: [6/7] a C++ compiler for --compile") + 1]
    if uid == "0" and pathlib.Path("/etc/debian_version").exists():
        assert compiler == "install.sh: installed Debian's g++"
        assert (tmp_path / "apt.log").read_text().splitlines() == [
            "apt-get update -qq", "apt-get install -y -qq --no-install-recommends g++"]
    else:
        assert compiler.startswith("install.sh: note: no C++ compiler (g++); --compile auto decodes eagerly")
        assert not (tmp_path / "apt.log").exists()
