"""The layering rules of docs/architecture.md, enforced by walking imports (tests/unit/import_graph.py)."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests.unit.import_graph import (cycles, edges, forbidden_imports, module_graph, package_graph,
                                     unit_of, upward_imports)

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOT = REPO / "radixserve"

# unit (subpackage or root module) -> units it must not import
FORBIDDEN = {
    "engine": {"runner", "models", "layers", "weights", "server", "tokenizer", "disagg", "chaos", "dist"},
    # prefill/decode disaggregation: a worker driving an Engine and a side, plus the transport;
    # tensors stay in runner, and fault injection plugs into its seams from outside
    "disagg": {"runner", "models", "layers", "weights", "server", "tokenizer", "chaos", "dist"},
    # fault injection implements the seams of engine/ and disagg/ (their hooks and types); the
    # composition root installs it and the HTTP side arms it, so it never imports them back
    "chaos": {"runner", "models", "layers", "weights", "server", "tokenizer", "parsers", "router",
              "agent", "bench", "chat"},
    # collectives over torch.distributed: below the runner, which drives them; layers and models see them only
    # through layers/parallel.py's Collectives protocol
    "dist": {"engine", "runner", "models", "layers", "weights", "server", "tokenizer", "disagg", "chaos", "parsers",
             "router", "agent", "bench", "chat"},
    # the runner executes steps: it sees the engine's step types, never a feature that drives it
    "runner": {"chaos", "disagg", "server", "router", "agent", "bench", "chat"},
    "layers": {"runner", "models", "weights", "engine", "server", "tokenizer", "dist"},
    "models": {"runner", "engine", "server", "tokenizer", "dist"},
    "weights": {"runner", "engine", "server", "tokenizer", "disagg", "chaos", "dist"},
    # text in and out: the HTTP side and the runner's grammars use it, it uses neither
    "tokenizer": {"runner", "models", "layers", "engine", "server", "disagg", "chaos", "router",
                  "agent", "bench", "chat"},
    "server": {"runner", "models", "layers", "weights", "dist"},
    # router, agent and bench speak HTTP to workers; the router and bench may load a tokenizer.
    "router": {"runner", "models", "layers", "weights", "engine", "server", "agent", "bench", "chaos",
               "disagg"},
    "agent": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "bench", "chaos",
              "disagg"},
    "bench": {"runner", "models", "layers", "weights", "engine", "server", "router", "agent", "chaos",
              "disagg"},
    # output parsers work on text alone: the server feeds them, the CLI lists their names
    "parsers": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "router",
                "agent", "bench", "chaos", "disagg"},
    # the terminal chat speaks HTTP, or reaches a model only through the offline API (llm.py)
    "chat": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "router",
             "agent", "bench", "chaos", "disagg"},
}
# The composition roots build the pieces and wire them together: they may import anything, and
# nothing below them imports them (compose: the engine process's root, where build_engine lives).
COMPOSITION_ROOTS = {"cli", "llm", "__main__", "compose"}
# (importing unit, imported module) allowed against the two rules above:
UPWARD_EXCEPTIONS = {
    # the --tool-call-parser / --reasoning-parser choices are the parser registries' keys;
    # parsers/ imports nothing of radixserve, so no cycle can form
    ("server_config", "radixserve.parsers.chat_output"),
    # the terminal chat's local mode is the offline API
    ("chat", "radixserve.llm"),
    # the package's public API (radixserve.LLM), imported lazily
    ("radixserve", "radixserve.llm"),
}
# engine/engine.py may import torch (it does not today)
NO_TORCH = {"engine", "disagg", "chaos", "router", "agent", "parsers", "chat"}
# The engine loop and its wire messages speak ZMQ / msgpack; the rest of engine/ stays stdlib.
IPC = {"zmq", "msgspec"}
ENGINE_IPC_FILES = {"loop.py", "messages.py"}


def imports_of(path: pathlib.Path) -> set[str]:
    """Top-level names of every import in one file (third-party rules: torch, zmq, triton)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def files_of(package: str):
    folder = ROOT / package
    return sorted(folder.rglob("*.py")) if folder.is_dir() else []


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return ", ".join(f"{a} -> {b}" for a, b in edges(graph) if a in inside and b in inside)


def test_no_module_cycles():
    graph = module_graph(ROOT)
    assert not cycles(graph), "import cycles: " + "; ".join(describe(graph, c) for c in cycles(graph))


def test_no_package_cycles():
    graph = package_graph(module_graph(ROOT))
    assert not cycles(graph), "package cycles: " + "; ".join(describe(graph, c) for c in cycles(graph))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_forbidden_imports(package):
    bad = [line for line in forbidden_imports(ROOT, FORBIDDEN)
           if line.startswith(f"radixserve.{package}.") or line.startswith(f"radixserve.{package} ")]
    assert not bad, bad


def test_no_upward_imports():
    """Root modules import no subpackage, and nothing imports a composition root."""
    assert not upward_imports(ROOT, COMPOSITION_ROOTS, UPWARD_EXCEPTIONS)


def test_upward_exceptions_are_live():
    """Each exception is still needed; a stale one is removed, not kept as permission."""
    used = {(unit_of(m), t) for m, t in edges(module_graph(ROOT))}
    assert UPWARD_EXCEPTIONS <= used, UPWARD_EXCEPTIONS - used


@pytest.mark.parametrize("package", sorted(NO_TORCH))
def test_third_party_imports(package):
    for path in files_of(package):
        for name in imports_of(path):
            top = name.split(".")[0]
            if path.name != "engine.py":
                assert top != "torch", f"{path.name} imports torch"
            if package == "engine" and path.name not in ENGINE_IPC_FILES:
                assert top not in IPC, f"{path.name} imports {name}"


def test_engine_ipc_rule_is_live():
    """The loop files exist and really use the exemption, so the rule above is not vacuous."""
    for name in ENGINE_IPC_FILES:
        assert {n.split(".")[0] for n in imports_of(ROOT / "engine" / name)} & IPC, name


def test_every_module_has_a_docstring():
    for path in ROOT.rglob("*.py"):
        if path.stat().st_size:
            assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


def test_attention_backends_import_only_runner_and_the_attention_protocol():
    """Backends see the step (runner/batch.py), the KV accessor (runner/kv_cache.py) and each
    other, and the built C++ kernels (radixserve/csrc, a leaf); never the engine, models or weights (docs/runner.md:
    one KV accessor)."""
    allowed = ("radixserve.runner.", "radixserve.layers.attention", "radixserve.csrc")
    for path in files_of("runner/attention"):
        for name in imports_of(path):
            if name.startswith("radixserve"):
                assert name.startswith(allowed), f"{path.name} imports {name}"


def test_triton_is_imported_only_by_attention_backends():
    """triton is optional (CUDA machines): only runner/attention may import it, and only the
    triton backend's modules, which base.py imports lazily when that backend is chosen."""
    for path in ROOT.rglob("*.py"):
        if any(name.split(".")[0] == "triton" for name in imports_of(path)):
            assert path.parent == ROOT / "runner" / "attention" and path.name.startswith("triton_"), (
                f"{path} imports triton")


# A reference to a Markdown file in code, tests, benchmarks, the README or docs/ names a file in this repo.
MD_REF = re.compile(r"[\w./-]+\.md\b")


def test_markdown_references_exist():
    files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*.md") if ".git" not in p.parts}
    dangling = []
    sources = [p for folder in ("radixserve", "tests", "benchmarks") for p in sorted((REPO / folder).rglob("*.py"))]
    for path in sources + [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for ref in MD_REF.findall(line):
                ref = ref.removeprefix("./")
                if ref not in files and not any(f.endswith("/" + ref) for f in files):
                    dangling.append(f"{path.relative_to(REPO)}:{n}: {ref}")
    assert not dangling, dangling


# The checker itself: each rule fails on a planted violation in a tiny tree.

def plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "radixserve"
    for name, body in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(body)
    return root


def test_checker_finds_a_two_module_cycle(tmp_path):
    root = plant(tmp_path, {"router/app.py": "def f():\n    from radixserve.router import admin\n",
                            "router/admin.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from .app import State\n",
                            "router/other.py": "from radixserve.router.app import f\n"})
    assert cycles(module_graph(root)) == [["radixserve.router.admin", "radixserve.router.app"]]


def test_checker_finds_a_package_cycle(tmp_path):
    root = plant(tmp_path, {"engine/loop.py": "import radixserve.disagg.worker\n",
                            "disagg/worker.py": "from radixserve.engine.engine import Engine\n",
                            "engine/engine.py": "class Engine: pass\n"})
    graph = module_graph(root)
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["disagg", "engine"]]


def test_checker_finds_engine_importing_disagg(tmp_path):
    root = plant(tmp_path, {"engine/loop.py": "def build():\n    from radixserve.disagg import worker\n",
                            "disagg/worker.py": ""})
    assert forbidden_imports(root, FORBIDDEN) == ["radixserve.engine.loop imports radixserve.disagg.worker"]


def test_checker_finds_an_upward_import(tmp_path):
    root = plant(tmp_path, {"config.py": "from radixserve.server.native_tools import FORMATS\n",
                            "cli.py": "import radixserve.server.app\n",
                            "server/native_tools.py": "", "server/app.py": "from radixserve import cli\n"})
    assert upward_imports(root, COMPOSITION_ROOTS, set()) == [
        "radixserve.config imports radixserve.server.native_tools",
        "radixserve.server.app imports radixserve.cli"]
