"""The compiled decode's cache key (C61): every setting that changes a graph is in it, so a changed one never loads
another configuration's artifact; and which runners compile at all (runner/compile_setup.py)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner import compile_setup
from radixserve.runner.compiled_decode import buckets, graph_key
from tests.conftest import build_tiny_llama

# Settings that change what a decode graph traces or how it rounds, each with another valid value.
GRAPH_SETTINGS = {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "page_size": 32, "quantization": "int4",
                  "quantized_max_tokens": 12, "attention_backend": "torch", "disable_cascade_attention": True,
                  "context_length": 256, "num_threads": 1, "torch_compile_max_bs": 2, "device": "cpu",
                  "enable_deterministic_inference": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("m"), vocab_size=128)


def key(config: EngineConfig, model: torch.nn.Module, max_bs: int = 8) -> str:
    return graph_key(compile_setup.key_fields(config, model, max_bs))


def test_every_graph_setting_changes_the_key(model_dir):
    model = torch.nn.Linear(4, 4)
    base = EngineConfig(model_path=str(model_dir))
    seen = {key(base, model)}
    for name, value in GRAPH_SETTINGS.items():
        assert getattr(base, name) != value, name
        seen.add(key(dataclasses.replace(base, **{name: value}), model))
        assert len(seen) == 2 + list(GRAPH_SETTINGS).index(name), f"{name} is not in the compile key"
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert compile_setup.NOT_IN_KEY <= fields, compile_setup.NOT_IN_KEY - fields   # no stale names
    assert not compile_setup.NOT_IN_KEY & set(GRAPH_SETTINGS)


def test_model_files_weights_and_buckets_are_in_the_key(model_dir, tmp_path):
    base = EngineConfig(model_path=str(model_dir))
    model = torch.nn.Linear(4, 4)
    first = key(base, model)
    assert key(base, torch.nn.Linear(4, 5)) != first        # parameter shapes
    assert key(base, model.to(torch.bfloat16)) != first     # parameter dtypes
    assert key(base, torch.nn.Linear(4, 4), max_bs=4) != first
    other = build_tiny_llama(tmp_path, vocab_size=128)       # same shapes, another checkpoint
    assert key(dataclasses.replace(base, model_path=str(other)), torch.nn.Linear(4, 4)) != first
    assert key(base, torch.nn.Linear(4, 4)) == first         # and nothing else: a restart reuses it


def test_speculation_keys_only_the_hidden_output(model_dir):
    """Drafts are verified in eager steps, so a graph is the same with or without speculation; an EAGLE / NextN
    draft's graphs also return the final hidden state, a graph of their own."""
    base = EngineConfig(model_path=str(model_dir))
    model = torch.nn.Linear(4, 4)
    plain = key(base, model)
    for flags in (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3),
                  dict(speculative_algorithm="draft", speculative_draft_layers=1)):
        assert key(dataclasses.replace(base, **flags), model) == plain, flags
    eagle = dataclasses.replace(base, speculative_algorithm="EAGLE")
    assert key(eagle, model) != plain
    assert key(dataclasses.replace(eagle, speculative_num_steps=2, speculative_num_draft_tokens=3), model) == key(
        eagle, model)


def test_buckets():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6]


def test_off_and_unsupported_runners_decode_eagerly(model_dir, caplog):
    model = torch.nn.Linear(4, 4)
    model.config = type("C", (), {"mla": None})()
    cpu = torch.device("cpu")
    assert compile_setup.load_decode_graphs(model, EngineConfig(model_path=str(model_dir), compile="off"), cpu) is None
    det = EngineConfig(model_path=str(model_dir), compile="auto", enable_deterministic_inference=True)
    with caplog.at_level("INFO"):
        assert compile_setup.load_decode_graphs(model, det, cpu) is None
    assert "compiled decode off, decoding eagerly: --enable-deterministic-inference" in caplog.text
    for flags, why in [(dict(pp_size=2), "--pp-size > 1"), (dict(kv_cache_dtype="fp8_e4m3", kv_history_dtype="auto"),
                                                            "--kv-history-dtype auto")]:
        with caplog.at_level("INFO"):
            assert compile_setup.load_decode_graphs(model, EngineConfig(model_path=str(model_dir), compile="auto", **flags),
                                                      cpu) is None
        assert why in caplog.text
    assert EngineConfig(enable_torch_compile=True).compile_mode == "on"
    assert EngineConfig(enable_torch_compile=True, compile="on").compile_mode == "on"
    with pytest.raises(ValueError, match="contradicts --compile off"):
        EngineConfig(enable_torch_compile=True, compile="off")


def test_auto_without_a_compiler_decodes_eagerly(model_dir, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    model = torch.nn.Linear(4, 4)
    model.config = type("C", (), {"mla": None})()
    with caplog.at_level("INFO"):
        got = compile_setup.load_decode_graphs(model, EngineConfig(model_path=str(model_dir), compile="auto"),
                                               torch.device("cpu"))
    assert got is None
    assert [r.getMessage() for r in caplog.records if "compiled decode" in r.getMessage()] == [
        "compiled decode off, decoding eagerly: no C++ compiler (g++, clang++, c++) on PATH"]


def test_compile_default_is_auto_unless_the_environment_sets_it():
    """--compile's default comes from $RADIXSERVE_COMPILE as it is when a config is made (the suite pins off), else
    auto; a bad value is refused."""
    code = "from radixserve.engine_config import EngineConfig as E; print(E().compile, E().torch_compile_max_bs)"
    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_COMPILE"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra},   # noqa: E731
                                       capture_output=True, text=True)
    assert run({}).stdout.split() == ["auto", "1"]
    assert run({"RADIXSERVE_COMPILE": "off"}).stdout.split() == ["off", "1"]
    bad = run({"RADIXSERVE_COMPILE": "yes"})
    assert bad.returncode != 0 and "must be auto, on or off" in bad.stderr
    late = ("import os; from radixserve.engine_config import EngineConfig as E; "
            "os.environ['RADIXSERVE_COMPILE'] = 'on'; print(E().compile)")
    got = subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True)
    assert got.stdout.split() == ["on"], got.stderr
