"""benchmarks/comment_ratio.py: its line counting, and radixserve/'s docstring + comment share (at most 0.12)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "comment_ratio", Path(__file__).resolve().parents[2] / "benchmarks" / "comment_ratio.py")
comment_ratio = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(comment_ratio)

SAMPLE = '''"""Module docstring,
two lines."""

x = 1  # a trailing comment makes this a doc line


def f():
    """One line."""
    # a comment
    return x
'''


def test_counting():
    # doc: 2 (module) + 1 (x's comment) + 1 (f's docstring) + 1 (comment); code: def, return
    assert comment_ratio.count_lines(SAMPLE) == (5, 2)


def test_by_package(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text(SAMPLE)
    (tmp_path / "config.py").write_text("x = 1\n")
    assert comment_ratio.by_package(tmp_path) == {"engine": (5, 2), "(root modules)": (0, 1)}


def test_comment_ratio_is_at_most_0_12():
    """Comments state contracts; measurements and history live in docs/benchmarks.md and commits."""
    ratio = comment_ratio.overall()
    assert ratio <= 0.12, f"docstring + comment lines are {ratio:.2f} of code lines (benchmarks/comment_ratio.py)"
