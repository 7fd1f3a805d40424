"""GGUF loading: llama.cpp's q/k permutation undone, dequantized weights cached, and the embedded
default model's greedy continuation equal to transformers loading the same GGUF."""
from __future__ import annotations

import os

import pytest
import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from radixserve.weights import gguf as gguf_weights
from radixserve.weights.loader import load_checkpoint
from radixserve.weights.paths import resolve_model_path
from tests.conftest import build_tiny_llama
from tests.model.gguf_convert import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=64, logprobs=0)


def greedy(runner: ModelRunner, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Prefill + decode through the runner; returns tokens and each step's logprob."""
    pages = list(range(1, 1 + -(-(len(prompt) + num_tokens) // runner.page_size)))
    out, lps = [], []
    start, ids = 0, prompt
    for _ in range(num_tokens):
        seq = ScheduledSeq("g", ids, start, pages, True, GREEDY, 0, prompt, list(out), 0, None)
        token = runner.run([seq])[0].logprobs[-1]
        start += len(ids)
        out.append(token.token_id)
        lps.append(token.logprob)
        ids = [token.token_id]
    return out, lps


def test_tiny_gguf_matches_safetensors_and_is_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = build_tiny_llama(tmp_path / "hf", vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_dir, path)
    first_run = "first run: dequantizing GGUF tiny.gguf to fp32, cached for next time"
    with caplog.at_level("INFO", logger="radixserve.weights.gguf"):
        config, weights = load_checkpoint(str(path))
    assert [r.getMessage() for r in caplog.records if first_run in r.getMessage()], caplog.text
    caplog.clear()
    ref_config, ref_weights = load_checkpoint(str(hf_dir))
    assert (config.num_heads, config.num_kv_heads, config.vocab_size, config.tie_word_embeddings) == (4, 2, 256, True)
    got, ref = dict(weights), dict(ref_weights)
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.float()), name   # permutation undone exactly
    assert os.path.exists(gguf_weights.cache_path(str(path)))

    def no_dequantize(_path):
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(gguf_weights, "_dequantized", no_dequantize)
    with caplog.at_level("INFO", logger="radixserve.weights.gguf"):
        cached_config, cached = load_checkpoint(str(path))
    assert "first run" not in caplog.text
    assert cached_config == config
    assert all(torch.equal(t, got[n]) for n, t in cached)
    runner = ModelRunner.from_config(EngineConfig(model_path=str(path), page_size=4, max_total_tokens=256,
                                                  quantization="none"))
    ref_runner = ModelRunner.from_config(EngineConfig(model_path=str(hf_dir), page_size=4, max_total_tokens=256))
    assert greedy(runner, [5, 6, 7, 8, 9], 6) == greedy(ref_runner, [5, 6, 7, 8, 9], 6)


def test_default_gguf_greedy_matches_transformers(default_hf, default_tokenizer):
    path = resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    prompt = default_tokenizer.hf.encode("The capital of France is")
    runner = ModelRunner.from_config(EngineConfig(page_size=16, max_total_tokens=1024, quantization="none"))
    assert runner.vocab_size == 49152 and 2 in runner.eos_token_ids
    ours, _ = greedy(runner, prompt, 16)
    with torch.inference_mode():
        ref = default_hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    theirs = ref.sequences[0, len(prompt):].tolist()
    if ours != theirs:
        i = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        top = torch.topk(ref.logits[i][0].float(), 2).values
        pytest.fail(f"first difference at output position {i}: ours {ours[i]}, transformers "
                    f"{theirs[i]}, top-2 logit gap {float(top[0] - top[1]):.3g}")
