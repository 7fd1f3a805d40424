"""The design's layering rules, enforced by walking imports (ARCHITECTURE.md §2)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "radixserve"

# package (folder or module) -> radixserve subpackages it must not import
FORBIDDEN = {
    "engine": {"runner", "models", "layers", "weights", "server", "tokenizer", "disagg", "chaos",
               "compose", "cli"},
    # prefill/decode disaggregation: a worker driving an Engine, plus its transport
    "disagg": {"runner", "models", "layers", "weights", "server", "tokenizer", "chaos", "compose",
               "cli"},
    # fault injection attaches to the engine's seams; the HTTP side calls it, never the reverse
    "chaos": {"runner", "models", "layers", "weights", "server", "tokenizer", "compose", "cli"},
    "runner": {"server", "chaos", "disagg", "compose", "cli"},
    "layers": {"runner", "models", "weights", "engine", "server", "tokenizer"},
    "models": {"runner", "engine", "server", "tokenizer"},
    "server": {"runner", "models", "layers", "weights"},
    # router, agent and bench speak HTTP to workers; the router may load a tokenizer.
    "router": {"runner", "models", "layers", "weights", "engine", "server", "agent", "bench"},
    "agent": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "bench"},
    # output parsers work on text alone: the server feeds them, the CLI lists their names
    "parsers": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "router",
                "agent", "bench"},
    # the terminal chat speaks HTTP, or reaches a model only through the offline API (llm.py)
    "chat": {"runner", "models", "layers", "weights", "engine", "server", "tokenizer", "router",
             "agent", "bench"},
}
NO_TORCH = {"engine", "disagg", "chaos", "router", "agent", "parsers", "chat"}  # engine/engine.py may import torch (it does not today)
# The engine loop and its wire messages speak ZMQ / msgpack; the rest of engine/ stays stdlib.
IPC = {"zmq", "msgspec"}
ENGINE_IPC_FILES = {"loop.py", "messages.py"}


def imports_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def files_of(package: str):
    folder = ROOT / package
    return sorted(folder.rglob("*.py")) if folder.is_dir() else []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    for path in files_of(package):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "radixserve" and len(parts) > 1:
                assert parts[1] not in FORBIDDEN[package], f"{path.name} imports {name}"
            if package in NO_TORCH and path.name != "engine.py":
                assert parts[0] != "torch", f"{path.name} imports torch"
            if package == "engine" and path.name not in ENGINE_IPC_FILES:
                assert parts[0] not in IPC, f"{path.name} imports {name}"


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
    other; never the engine, models or weights (ARCHITECTURE.md §8: one KV accessor)."""
    allowed = ("radixserve.runner.", "radixserve.layers.attention")
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
