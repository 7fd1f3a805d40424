"""--quantization on a tiny GGUF Llama (Q4_0 / Q4_1 linear weights, Q8_0 embedding): int4 logits
match the same file's fp32 dequantization, greedy tokens agree, the int4 cache round-trips, and
the flag is validated."""
from __future__ import annotations

import logging

import pytest
import torch

from radixserve.cli import build_parser
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.layers import quant_linear
from radixserve.layers.linear import Linear
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from radixserve.weights import gguf as gguf_weights
from radixserve.weights.checkpoint_config import (AUTO_QUANTIZED_MAX_TOKENS, resolve_quantization,
                                                 resolve_quantized_max_tokens)
from tests.conftest import build_tiny_llama
from tests.model.gguf_convert import write_gguf
from tests.model.test_gguf import greedy

TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
         "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
PROMPT = [5, 17, 33, 9, 120, 64, 7, 200, 31, 45, 88, 3, 150, 99, 12, 71]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-q4")
    hf_dir = build_tiny_llama(folder / "hf", vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
    write_gguf(hf_dir, folder / "tiny-q4.gguf", TYPES)
    return folder / "tiny-q4.gguf", hf_dir


def runner(path, quantization: str, quantized_max_tokens: int = 0) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(model_path=str(path), page_size=4, max_total_tokens=256,
                                                quantization=quantization,
                                                quantized_max_tokens=quantized_max_tokens))


def prompt_logits(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), V) fp32 logits of one prefill, read at the LM head."""
    seen = []
    hook = r.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.float()))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    pages = list(range(1, 1 + -(-len(prompt) // r.page_size)))
    r.run([ScheduledSeq("p", prompt, 0, pages, True, params, 0, prompt, [], 0, 0)])
    hook.remove()
    return seen[0]


def test_int4_logits_match_the_dequantized_twin(tiny_q4, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    path, _ = tiny_q4
    fp32, int4 = runner(path, "none"), runner(path, "int4")
    quantized = [m for m in int4.model.modules() if isinstance(m, Linear) and m._quant is not None]
    assert len(quantized) == 2 * 4, "qkv, o, gate_up and down of both layers run on the int4 kernel"
    assert fp32.model.lm_head._small_head is None, "the unquantized model's head stays fp32-exact"
    assert int4.model.lm_head._small_head is not None, "a quantized model's head screens small steps"
    ref, got = prompt_logits(fp32, PROMPT), prompt_logits(int4, PROMPT)
    assert got.shape == ref.shape == (len(PROMPT), 256)
    # bf16 activations and scales inside the kernel: a few 1e-3 of the logits' scale.
    err = float((got - ref).abs().max())
    assert err <= 2e-2 * float(ref.abs().max()), err
    top2 = ref.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err          # positions that are not near-ties
    assert clear.sum() >= len(PROMPT) // 2
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    tokens, _ = greedy(int4, PROMPT, 8)
    ref_tokens, _ = greedy(fp32, PROMPT, 8)
    assert tokens == ref_tokens


def test_large_steps_of_a_quantized_model_match_the_twin(tiny_q4, monkeypatch, tmp_path):
    """--quantized-max-tokens 4: the 16-token prefill runs the quantized layers on their float
    copy (bf16 where this CPU multiplies bf16 natively, else fp32) and the 16 logit rows on
    the fp32 head; logits stay within the int4 kernel's bound of the fp32 twin, and greedy
    decoding (small steps on the int4 kernel) gives the same tokens."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    path, _ = tiny_q4
    fp32, mixed = runner(path, "none"), runner(path, "int4", quantized_max_tokens=4)
    layers = [m for m in mixed.model.modules() if isinstance(m, Linear) and m._quant is not None]
    want = torch.bfloat16 if quant_linear.native_bf16() else torch.float32
    assert len(layers) == 8 and all(m._packed_dtype == want for m in layers)
    assert mixed.model.lm_head._packed_dtype == torch.float32
    ref, got = prompt_logits(fp32, PROMPT), prompt_logits(mixed, PROMPT)
    err = float((got - ref).abs().max())
    assert err <= 2e-2 * float(ref.abs().max()), err
    tokens, _ = greedy(mixed, PROMPT, 8)
    assert tokens == greedy(fp32, PROMPT, 8)[0]


def test_int4_cache_round_trips(tiny_q4, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    path, _ = tiny_q4
    _, first = gguf_weights.load_gguf(str(path), "int4")
    first = dict(first)
    assert gguf_weights.cache_path(str(path), "int4") != gguf_weights.cache_path(str(path))
    _, cached = gguf_weights.load_gguf(str(path), "int4")
    cached = dict(cached)
    assert set(cached) == set(first)
    for name, t in first.items():
        other = cached[name]
        assert type(other) is type(t), name
        parts = (t.codes, t.scale, t.zero) if hasattr(t, "codes") else (t,)
        others = (other.codes, other.scale, other.zero) if hasattr(other, "codes") else (other,)
        assert all(torch.equal(a, b) for a, b in zip(parts, others)), name


def test_int8_requantizes_every_linear_weight(tiny_q4, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    path, _ = tiny_q4
    fp32, int8 = runner(path, "none"), runner(path, "int8")
    assert sum(isinstance(m, Linear) and m._quant is not None for m in int8.model.modules()) == 8
    ref, got = prompt_logits(fp32, PROMPT), prompt_logits(int8, PROMPT)
    assert float((got - ref).abs().max()) <= 5e-2 * float(ref.abs().max())


def test_quantization_flag_validation(tiny_q4, caplog):
    path, hf_dir = tiny_q4
    with pytest.raises(ValueError, match="cannot be combined with --enable-deterministic-inference"):
        EngineConfig(quantization="int4", enable_deterministic_inference=True)
    EngineConfig(quantization="auto", enable_deterministic_inference=True)   # int4-fp32 is batch-invariant
    assert resolve_quantization("auto", str(path), own_int4_kernel=True) == "int4-fp32"
    assert resolve_quantization("auto", str(hf_dir), own_int4_kernel=True) == "none"
    with caplog.at_level(logging.INFO, logger="radixserve.weights.checkpoint_config"):
        assert resolve_quantization("auto", str(path)) == "none"   # the kernel not built, or not on a CPU
    assert "int4-fp32 kernel does not run here" in caplog.text
    auto, det = EngineConfig(), EngineConfig(enable_deterministic_inference=True)
    assert resolve_quantized_max_tokens(auto, "int4-fp32", "avx512") == AUTO_QUANTIZED_MAX_TOKENS["avx512"] == 16
    assert resolve_quantized_max_tokens(auto, "int4-fp32", "avx2") == AUTO_QUANTIZED_MAX_TOKENS["avx2"] == 8
    assert resolve_quantized_max_tokens(det, "int4-fp32") == 0   # a row must not change path with the step
    assert resolve_quantized_max_tokens(auto, "none") == 0
    assert resolve_quantized_max_tokens(EngineConfig(quantization="int4"), "int4") == 0
    assert resolve_quantized_max_tokens(EngineConfig(quantized_max_tokens=0), "int4-fp32") == 0
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_quantization("int4", str(hf_dir))
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert args.quantization == "int8"
    assert build_parser().parse_args(["serve"]).quantization == EngineConfig().quantization
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp4"])


def test_quantized_max_tokens_without_a_quantized_layer_says_so(tiny_q4, caplog):
    _, hf_dir = tiny_q4
    with caplog.at_level(logging.WARNING, logger="radixserve.runner.model_runner"):
        ModelRunner.from_config(EngineConfig(model_path=str(hf_dir), quantized_max_tokens=8, max_total_tokens=512))
    assert "--quantized-max-tokens 8 has no effect" in caplog.text
