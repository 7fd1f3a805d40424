"""benchmarks/flops.py: the FLOP counts the offline benchmark compares, against counts done by hand."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_flops", Path(__file__).resolve().parents[2] / "benchmarks" / "flops.py")
flops = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = flops      # dataclasses look their module up there
_spec.loader.exec_module(flops)

DIMS = flops.Dims(hidden=8, intermediate=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, vocab=10)


def _by_hand_linear() -> int:
    q, kv = 4 * 2, 2 * 2
    per_layer = 8 * q + 8 * kv + 8 * kv + q * 8 + 8 * 16 * 2 + 16 * 8     # q, k, v, o, gate, up, down
    return 2 * per_layer * 2


def _by_hand_attention(positions: range) -> int:
    return sum(4 * (p + 1) * 4 * 2 * 2 for p in positions)    # keys x heads x head_dim x layers


def test_per_token_counts_match_the_layer_shapes():
    assert DIMS.linear_per_token == _by_hand_linear()
    assert DIMS.head_per_row == 2 * 10 * 8
    assert DIMS.attention(3, 7) == _by_hand_attention(range(3, 7))
    assert DIMS.attention(5, 5) == 0


def test_a_serving_engine_is_charged_for_uncached_prompt_tokens_and_decode_steps_only():
    # prompt 10 tokens, 6 from the cache, 3 output tokens: positions 6..9 prefill, 10..11 decode.
    got = flops.serving_flops(DIMS, [(10, 6, 3)])
    want = _by_hand_linear() * 6 + DIMS.head_per_row * 3 + _by_hand_attention(range(6, 12))
    assert got == want
    assert flops.serving_flops(DIMS, [(10, 0, 3)]) > got, "cached tokens must save work"


def test_a_padded_batch_pays_linear_work_on_its_padding_and_attention_on_real_tokens_only():
    # rows of 4 and 7 prompt tokens padded to 7, 2 new tokens each (one decode step per row).
    got = flops.padded_batch_flops(DIMS, [([4, 7], 2)])
    want = (_by_hand_linear() * 2 * (7 + 1) + DIMS.head_per_row * 2 * 2
            + _by_hand_attention(range(0, 5)) + _by_hand_attention(range(0, 8)))
    assert got == want


def test_moe_models_are_refused():
    class Config:
        moe = object()
    with pytest.raises(ValueError):
        flops.Dims.of(Config())
