"""C64: a checkpoint's sliding window, read per layer as transformers 5.25 applies it (compared with the windows of
transformers' own model), is refused at start-up where it can bind within the context (`radixserve serve` exits 2 in
one line, ModelRunner, which the offline LLM loads, raises ValueError): (a) a 16-token window on every layer, Mistral
and Qwen2 `use_sliding_window`; (b) `layer_types` interleaving sliding and full; GGUF `attention.sliding_window`.
Served with full attention, logits within 1e-3 of transformers at prompt lengths 8, 16, 17, 64 and 200, through
chunked prefill and a prefix hit (test_mla_yarn.check_every_path): (c) `sliding_window` set over all-full layers
(Qwen2 `use_sliding_window: false`, Qwen2 / Qwen3 `layer_types` all full_attention, vllm #49795) and a window no
shorter than the context."""
from __future__ import annotations

import json

import pytest
import torch

from radixserve import cli
from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.weights.safetensors import read_hf_config
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_mla_yarn import PAGE, check_every_path
from tests.unit.test_cli import no_serving  # noqa: F401 (a fixture: serve() fails the test)

LENGTHS = [8, 16, 17, 64, 200]
SLIDE, FULL = "sliding_attention", "full_attention"
DENSE = FAMILIES["qwen3"][2]   # intermediate 128, 2 KV heads, head_dim 16
QWEN2, QWEN3 = ("Qwen2Config", "Qwen2ForCausalLM"), ("Qwen3Config", "Qwen3ForCausalLM")
MISTRAL = ("MistralConfig", "MistralForCausalLM")
WINDOW = dict(sliding_window=16, num_hidden_layers=4)
REFUSED = {   # case -> (config and model class, config kwargs, config.json keys written, what the refusal names)
    "a_mistral": (MISTRAL, WINDOW, {}, "layers 0-3 use a 16-token sliding window (config.json sliding_window; "
                                       "MistralForCausalLM: every layer)"),
    "a_qwen2_use_sliding_window": (QWEN2, dict(WINDOW, use_sliding_window=True, max_window_layers=0), {},
                                   "layers 0-3 use a 16-token sliding window (config.json sliding_window, "
                                   "use_sliding_window, layer_types)"),
    "a_qwen2_max_window_layers": (QWEN2, dict(WINDOW, use_sliding_window=True, max_window_layers=1),
                                  dict(layer_types=None), "layers 1-3 use a 16-token sliding window (config.json "
                                                          "sliding_window, use_sliding_window, max_window_layers)"),
    "b_qwen3_interleaved": (QWEN3, dict(WINDOW, use_sliding_window=True, layer_types=[SLIDE, FULL, SLIDE, SLIDE]),
                            {}, "layers 0, 2-3 use a 16-token sliding window"),
}
SERVED = {   # case -> (config and model class, config kwargs, config.json keys written over save_pretrained's)
    "c_qwen2_use_sliding_window_false": (QWEN2, {}, dict(sliding_window=16, use_sliding_window=False,
                                                         max_window_layers=0, layer_types=None)),
    "c_qwen2_layer_types_full": (QWEN2, dict(sliding_window=16, use_sliding_window=True, layer_types=[FULL] * 2), {}),
    "c_qwen3_layer_types_full": (QWEN3, dict(sliding_window=16, use_sliding_window=True, layer_types=[FULL] * 2), {}),
    "mistral_window_not_shorter_than_context": (MISTRAL, dict(sliding_window=1024), {}),   # max positions 1024
}


def build(folder, classes: tuple[str, str], kwargs: dict, written: dict | None = None):
    """The tiny checkpoint (tests/model/test_families.py) with `written` keys set in its config.json (None: dropped)
    and an empty tokenizer.json, so that `radixserve serve` takes the folder."""
    build_family(folder, "", seed=3, spec=(*classes, {**DENSE, "vocab_size": 512, **kwargs}))   # check_every_path's ids
    path = folder / "config.json"
    cfg = {**json.loads(path.read_text()), **(written or {})}
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None or k not in (written or {})}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def hf_windows(hf) -> list[int | None]:
    """Each layer's window in transformers' model: Qwen2 / Qwen3 attention's own, Mistral's config's."""
    default = getattr(hf.config, "sliding_window", None)
    return [getattr(layer.self_attn, "sliding_window", default) for layer in hf.model.layers]


def our_windows(folder) -> list[int | None]:
    mc = ModelConfig.from_hf(read_hf_config(str(folder)))
    window = mc.sliding_window
    assert ModelConfig.from_json(mc.to_json()) == mc
    return [window.size if window and i in window.layers else None for i in range(mc.num_layers)]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_c64_a_window_that_binds_is_refused_at_start_up(tmp_path, case, no_serving, capsys):
    from transformers import AutoModelForCausalLM

    classes, kwargs, written, says = REFUSED[case]
    folder = build(tmp_path / "model", classes, kwargs, written)
    capsys.readouterr()   # transformers' progress bars
    assert cli.main(["serve", "--model-path", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve serve: error: {says}") and err.count("\n") == 1, err
    assert "shorter than the 1024-token context" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="shorter than the 1024-token context"):
        ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512))
    assert our_windows(folder) == hf_windows(AutoModelForCausalLM.from_pretrained(folder))


@pytest.mark.parametrize("written, says", [
    (dict(layer_types=[SLIDE, FULL], use_sliding_window=False, sliding_window=16),
     "config.json layer_types marks layer 0 sliding_attention, but use_sliding_window is false or sliding_window "
     "null: no window size"),   # transformers fails to build that layer's mask
    (dict(layer_types=[FULL, "chunked_attention"]), "config.json layer_types ['full_attention', 'chunked_attention']: "
                                                    "qwen2 takes 2 entries, each full_attention or sliding_attention"),
])
def test_c64_layer_types_without_a_window_or_of_other_kinds_are_refused(tmp_path, written, says, no_serving,
                                                                         capsys):
    folder = build(tmp_path / "model", QWEN2, {}, written)
    capsys.readouterr()
    assert cli.main(["serve", "--model-path", str(folder)]) == 2
    assert capsys.readouterr().err == f"radixserve serve: error: {says}\n"


def test_c64_a_window_the_context_cannot_outgrow_is_served(tmp_path, monkeypatch):
    """--context-length 16 with a 16-token window: no sequence outgrows it, full attention is exact."""
    classes, kwargs, _, _ = REFUSED["a_mistral"]
    folder = build(tmp_path / "model", classes, kwargs)
    served = []

    async def serve(*args):
        served.append(args)
        return 0
    monkeypatch.setattr("radixserve.server.app.serve", serve)
    assert cli.main(["serve", "--model-path", str(folder), "--port", "0", "--context-length", "16"]) == 0
    assert len(served) == 1
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512, context_length=16))
    assert runner.max_context_len == 16


@pytest.mark.parametrize("case", sorted(SERVED))
@torch.inference_mode()
def test_c64_full_attention_layers_are_served_equal_to_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    classes, kwargs, written = SERVED[case]
    folder = build(tmp_path / "model", classes, kwargs, written)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert all(w is None or w >= 1024 for w in hf_windows(hf))   # the reference attends in full up to 210 tokens
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=PAGE, max_total_tokens=2048))
    check_every_path(hf, runner, LENGTHS, f"{case}: ")
    assert our_windows(folder) == hf_windows(hf)


def write_gguf_header(path, window: int, pattern: int | list[bool] | None, add_pattern: str = "") -> str:
    """A tensor-less 4-layer `llama` GGUF file whose metadata carries gguf's `attention.sliding_window` (and
    `attention.sliding_window_pattern` unless None, of the type GGUFWriter's `add_pattern` method writes, e.g.
    "add_int32", else the type add_sliding_window_pattern gives it), context length 1024."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, 4), (writer.add_embedding_length, 64), (writer.add_head_count, 4),
                       (writer.add_feed_forward_length, 128), (writer.add_context_length, 1024),
                       (writer.add_vocab_size, 256), (writer.add_sliding_window, window)]:
        add(value)
    if add_pattern:
        getattr(writer, add_pattern)("llama.attention.sliding_window_pattern", pattern)
    elif pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("pattern, layers", [(None, "layers 0-3"), (0, "layers 0-3"), (2, "layers 0, 2"),
                                             ([True, False, False, True], "layers 0, 3")])
def test_c64_a_gguf_window_that_binds_is_refused_at_start_up(tmp_path, pattern, layers, no_serving, capsys):
    """An int pattern n as llama.cpp's set_swa_pattern (every n-th layer full), a list per layer, none: every layer."""
    path = write_gguf_header(tmp_path / "m.gguf", 16, pattern)
    assert cli.main(["serve", "--model-path", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve serve: error: {layers} use a 16-token sliding window (GGUF "
                          "llama.attention.sliding_window") and err.count("\n") == 1, err


def test_c64_a_gguf_window_as_long_as_the_context_is_served(tmp_path, monkeypatch):
    from radixserve.weights.checkpoint_config import check_checkpoint, read_model_config

    path = write_gguf_header(tmp_path / "m.gguf", 1024, None)
    assert read_model_config(path).sliding_window.layers == (0, 1, 2, 3)
    check_checkpoint(EngineConfig(model_path=path), path)


ODD = dict(use_sliding_window=True, sliding_window=16, layer_types=None)   # max_window_layers placing the window


@pytest.mark.parametrize("written, says", [
    (dict(ODD, max_window_layers=1.0), "config.json max_window_layers 1.0 is not a layer index"),
    (dict(ODD, max_window_layers="1"), "config.json max_window_layers '1' is not a layer index"),
    (dict(ODD, layer_types=5), "config.json layer_types 5 is not a list of layer kinds"),
    (dict(ODD, layer_types=[[SLIDE], FULL]), "config.json layer_types [['sliding_attention'], 'full_attention'] is "
                                             "not a list of layer kinds"),
    (dict(ODD, max_window_layers=0, max_position_embeddings="1024"),
     "context length '1024' (--context-length, else max_position_embeddings) is not a positive token count"),
    (dict(num_hidden_layers="2"), "its config has a value of the wrong type"),
])
def test_c64_config_values_of_the_wrong_type_are_refused_in_one_line(tmp_path, written, says, no_serving, capsys):
    """Values transformers' strict config classes refuse as well: exit 2 naming the key, not a TypeError traceback."""
    folder = build(tmp_path / "model", QWEN2, {}, written)
    capsys.readouterr()
    assert cli.main(["serve", "--model-path", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve serve: error: ") and says in err and err.count("\n") == 1, err


def test_c64_a_negative_max_window_layers_slides_every_layer(tmp_path):
    """transformers slides layer i where i >= max_window_layers: every layer, named from 0."""
    folder = build(tmp_path / "model", QWEN2, {}, dict(ODD, max_window_layers=-1))
    assert our_windows(folder) == [16, 16]
    with pytest.raises(ValueError, match=r"^layers 0-1 use a 16-token sliding window"):
        ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512))


@pytest.mark.parametrize("add_pattern, pattern", [("add_int32", -2), ("add_float32", 2.0), ("add_string", "abc")])
def test_c64_a_gguf_window_pattern_of_another_type_is_refused(tmp_path, add_pattern, pattern, no_serving, capsys):
    """Neither llama.cpp's layer count n >= 0 nor a per-layer list: refused even where the window cannot bind."""
    path = write_gguf_header(tmp_path / "m.gguf", 16, pattern, add_pattern)
    assert cli.main(["serve", "--model-path", path, "--context-length", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve serve: error: GGUF llama.attention.sliding_window, llama.attention."
                          f"sliding_window_pattern: sliding_window_pattern {pattern!r} is neither") and \
        err.count("\n") == 1, err


def test_c64_a_model_type_whose_window_radixserve_cannot_place_is_refused(tmp_path, no_serving, capsys):
    """MistralForCausalLM weights under model_type ministral: transformers builds MinistralForCausalLM, which windows
    every layer by its layer_types; served windowless before."""
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path / "model", MISTRAL, WINDOW, dict(model_type="ministral"))
    assert hf_windows(AutoModelForCausalLM.from_pretrained(folder)) == [16] * 4
    capsys.readouterr()
    assert cli.main(["serve", "--model-path", str(folder)]) == 2
    assert capsys.readouterr().err == ("radixserve serve: error: config.json model_type 'ministral' with sliding_window "
                                       "16: radixserve does not know which layers its config class windows\n")
