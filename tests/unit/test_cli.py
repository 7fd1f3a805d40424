"""`radixserve serve` fails fast and in one line on a taken port, a bad model path or flags the model cannot take."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

import radixserve
from radixserve import cli
from radixserve.weights.paths import ModelPathError, resolve_model_path

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def no_serving(monkeypatch):
    """Make loading the model a test failure: these start-ups must end before it."""
    def serve(*args, **kwargs):
        raise AssertionError("serve() was called: the model would have loaded")
    monkeypatch.setattr("radixserve.server.app.serve", serve)


def test_a_taken_port_fails_before_loading_in_one_line(taken_port, no_serving, capsys):
    code = cli.main(["serve", "--port", str(taken_port)])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"radixserve serve: error: cannot listen on 127.0.0.1:{taken_port}: already in "
                   f"use by another process (choose another with --host / --port)\n")


def test_a_taken_port_from_the_command_line_exits_nonzero_without_a_traceback(taken_port):
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--port", str(taken_port)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"radixserve serve: error: cannot listen on 127.0.0.1:{taken_port}: already in use by "
        f"another process (choose another with --host / --port)"]


def hf_folder(folder: pathlib.Path, *names: str) -> pathlib.Path:
    folder.mkdir()
    for name in names:
        (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize("names, says", [
    ((), "is an empty folder; give an HF model folder (config.json, *.safetensors, and "
         "tokenizer.json, tokenizer.model, vocab.json or vocab.txt) or a .gguf file"),
    (("README.md",), "is not an HF model folder: it lacks config.json and *.safetensors files and "
                     "a tokenizer file (tokenizer.json, tokenizer.model, vocab.json or vocab.txt)"),
    (("config.json", "tokenizer.json"), "is not an HF model folder: it lacks *.safetensors files"),
    (("config.json", "model.safetensors"), "is not an HF model folder: it lacks a tokenizer file"),
    (("model.safetensors", "x.gguf"), "is not an HF model folder: it lacks config.json and a tokenizer file (tokenizer.json, "
                                      "tokenizer.model, vocab.json or vocab.txt); to serve the GGUF "
                                      "file in it, give"),
])
def test_a_bad_model_folder_is_exit_2_naming_what_it_lacks(tmp_path, names, says, no_serving, capsys):
    folder = hf_folder(tmp_path / "model", *names)
    code = cli.main(["serve", "--model-path", str(folder)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"radixserve serve: error: model path {str(folder)!r} {says}"), err
    assert err.count("\n") == 1 and "sentencepiece" not in err and "Traceback" not in err


def test_a_bad_model_file_is_exit_2(tmp_path, no_serving, capsys):
    text, fake = tmp_path / "model.bin", tmp_path / "model.gguf"
    text.write_text("weights")
    fake.write_text("not a gguf")
    assert cli.main(["serve", "--model-path", str(tmp_path / "missing")]) == 2
    assert cli.main(["serve", "--model-path", str(text)]) == 2
    assert cli.main(["serve", "--model-path", str(fake)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"radixserve serve: error: model path {str(tmp_path / 'missing')!r} does not exist",
        f"radixserve serve: error: model path {str(text)!r} is a file but not a .gguf file; give a "
        f".gguf file or an HF model folder (config.json, *.safetensors, and tokenizer.json, "
        f"tokenizer.model, vocab.json or vocab.txt)",
        f"radixserve serve: error: model path {str(fake)!r} is not a GGUF file (it does not start "
        f"with 'GGUF')"]


def test_model_folders_the_runner_and_the_server_accept(tmp_path):
    weights_only = hf_folder(tmp_path / "weights", "config.json", "model-00001-of-00002.safetensors")
    assert resolve_model_path(str(weights_only)) == str(weights_only)  # the runner needs no tokenizer
    with pytest.raises(ModelPathError, match="lacks a tokenizer file"):
        resolve_model_path(str(weights_only), need_tokenizer=True)
    (weights_only / "tokenizer.model").write_bytes(b"\0")
    assert resolve_model_path(str(weights_only), need_tokenizer=True) == str(weights_only)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model_path(str(gguf), need_tokenizer=True) == str(gguf)


def test_version_prints_the_package_version():
    done = subprocess.run([sys.executable, "-m", "radixserve", "--version"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"radixserve {radixserve.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", radixserve.__version__)


@pytest.mark.parametrize("flags, names", [
    (["--enable-confidence-detector", "--confidence-window", "0"], "--confidence-window"),
    (["--confidence-min-drop", "nan"], "--confidence-min-drop"),
    (["--speculative-anomaly-max-accept-rate", "2"], "--speculative-anomaly-max-accept-rate"),
    (["--speculative-anomaly-max-accept-rate", "nan"], "--speculative-anomaly-max-accept-rate"),
    (["--speculative-anomaly-min-accept-length", "-1"], "--speculative-anomaly-min-accept-length"),
    (["--speculative-anomaly-min-tokens", "-5"], "--speculative-anomaly-min-tokens"),
    (["--speculative-anomaly-min-verify-steps", "-1"], "--speculative-anomaly-min-verify-steps"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "0"], "--speculative-num-steps must be in [1, 16]"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "100"], "--speculative-num-steps must be in [1, 16]"),
    (["--speculative-num-steps", "2"], "--speculative-num-steps needs --speculative-algorithm EAGLE"),
    (["--speculative-algorithm", "NGRAM", "--speculative-break-even-tokens", "nan"], "speculative_break_even_tokens"),
    (["--speculative-algorithm", "NGRAM", "--speculative-break-even-tokens", "-1"], "speculative_break_even_tokens"),
    (["--context-length", "-5"], "--context-length must be >= 0"),   # every request was refused as too long
])
def test_out_of_range_settings_are_exit_2_naming_the_flag(flags, names, no_serving, capsys):
    """A threshold no rule can use (a zero window divided by, a rate above 1, NaN) fails at start-up, in one line."""
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err, err


def tiny_hf_folder(folder: pathlib.Path, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> pathlib.Path:
    """An HF folder whose config.json is a real Llama config (the weights and tokenizer files are empty)."""
    hf_folder(folder, "model.safetensors", "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    return folder


@pytest.mark.parametrize("text, says", [("[]", "config.json: a JSON object of settings expected, not list"),
                                         ("null", "config.json: a JSON object of settings expected, not NoneType"),
                                         ("{bad", "config.json: not valid JSON (Expecting property name")])
def test_a_config_json_that_is_not_an_object_is_exit_2_naming_the_file(tmp_path, text, says, no_serving, capsys):
    """serve reads every HF folder's config.json before loading (the sliding-window check): no AttributeError."""
    folder = tiny_hf_folder(tmp_path / "model")
    (folder / "config.json").write_text(text)
    assert cli.main(["serve", "--model-path", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve serve: error: {folder / 'config.json'}") and says in err, err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("flags, says", [
    (["--pp-size", "3"], "--pp-size 3 exceeds the model's 2 layers"),
    (["--tp-size", "3"], "--tp-size 3 does not divide 4 attention heads and 2 KV heads"),
    (["--tp-size", "8"], "--tp-size 8 does not divide 4 attention heads"),
    (["--pp-size", "2", "--tp-size", "3"], "--pp-size 2 with --tp-size 3: the hidden size 64 does not divide"),
    (["--tp-size", "2", "--ep-size", "2"], "--ep-size 2 needs a mixture-of-experts model (llama has no routed"),
    (["--quantization", "int4"], "--quantization int4 reads GGUF blocks"),
    (["--quantization", "int8"], "--quantization int8 reads GGUF blocks"),
    (["--quantization", "int4-int8"], "--quantization int4-int8 reads GGUF blocks"),
    (["--quantization", "int4-fp32"], "--quantization int4-fp32 reads GGUF blocks"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE/NEXTN drafts with a checkpoint's NextN"),
])
def test_parallel_sizes_and_quantization_the_model_cannot_take_are_exit_2_before_loading(tmp_path, flags, says,
                                                                                         no_serving, capsys):
    folder = tiny_hf_folder(tmp_path / "model")
    assert cli.main(["serve", "--model-path", str(folder), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve serve: error: {says}") and err.count("\n") == 1, err


def test_a_pipeline_deeper_than_a_gguf_model_is_exit_2_naming_its_layers(no_serving, capsys):
    """The default model (a GGUF file of 30 layers): its metadata gives the count."""
    assert cli.main(["serve", "--pp-size", "31"]) == 2
    assert capsys.readouterr().err == "radixserve serve: error: --pp-size 31 exceeds the model's 30 layers\n"


@pytest.mark.parametrize("flags", [["--pp-size", "2"], ["--tp-size", "2"], ["--tp-size", "4"],
                                   ["--pp-size", "2", "--tp-size", "2"], ["--quantization", "none"],
                                   ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "head.st"]])
def test_sizes_the_model_takes_reach_loading(tmp_path, flags, monkeypatch):
    served = []

    async def serve(*args):
        served.append(args)
        return 0
    monkeypatch.setattr("radixserve.server.app.serve", serve)
    assert cli.main(["serve", "--model-path", str(tiny_hf_folder(tmp_path / "model")), "--port", "0", *flags]) == 0
    assert len(served) == 1


@pytest.mark.parametrize("value, parsed", [("NGRAM", "ngram"), ("ngram", "ngram"), ("eagle", "EAGLE"),
                                           ("None", None)])
def test_a_choice_is_taken_in_any_case(value, parsed):
    import argparse
    from radixserve.config import add_dataclass_args, from_args
    from radixserve.engine_config import EngineConfig
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    args = parser.parse_args(["--speculative-algorithm", value])
    assert from_args(EngineConfig, args).speculative_algorithm == parsed
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-algorithm", "ngrams"])
