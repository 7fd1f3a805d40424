"""Docstring + comment lines per code line in radixserve/, overall and per package.

    python benchmarks/comment_ratio.py [--json]

A non-blank line is a doc line when it is part of a module, class or function docstring or
carries a `#` comment (a code line with a trailing comment counts as doc); every other
non-blank line is code. tests/unit/test_comment_ratio.py holds the overall ratio to 0.12.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import pathlib
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1] / "radixserve"
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def count_lines(source: str) -> tuple[int, int]:
    """(doc lines, code lines) of one file's source."""
    doc_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, DOCUMENTED) and ast.get_docstring(node) is not None:
            first = node.body[0]
            doc_lines.update(range(first.lineno, first.end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            doc_lines.add(tok.start[0])
    lines = [n for n, line in enumerate(source.splitlines(), 1) if line.strip()]
    doc = sum(1 for n in lines if n in doc_lines)
    return doc, len(lines) - doc


def by_package(root: pathlib.Path = ROOT) -> dict[str, tuple[int, int]]:
    """Package (first folder under root, or "(root modules)") -> (doc lines, code lines)."""
    totals: dict[str, tuple[int, int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        package = rel[0] if len(rel) > 1 else "(root modules)"
        doc, code = count_lines(path.read_text())
        old_doc, old_code = totals.get(package, (0, 0))
        totals[package] = (old_doc + doc, old_code + code)
    return totals


def overall(root: pathlib.Path = ROOT) -> float:
    totals = by_package(root).values()
    return sum(d for d, _ in totals) / max(1, sum(c for _, c in totals))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    totals = by_package()
    if args.json:
        print(json.dumps({"overall": overall(), "packages": totals}))
        return
    print(f"{'package':<16} {'doc':>6} {'code':>6} {'ratio':>6}")
    for package, (doc, code) in sorted(totals.items()):
        print(f"{package:<16} {doc:>6} {code:>6} {doc / max(1, code):>6.2f}")
    doc, code = sum(d for d, _ in totals.values()), sum(c for _, c in totals.values())
    print(f"{'radixserve/':<16} {doc:>6} {code:>6} {doc / max(1, code):>6.2f}")


if __name__ == "__main__":
    main()
