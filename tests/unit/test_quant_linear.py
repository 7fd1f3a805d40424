"""Quantized linear layers: GGUF 4-bit blocks decode exactly, the int4 / int8 kernels reproduce
the dequantized weights within their stated bf16 bound, and layers that cannot run quantized
fall back to the same fp32 weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from radixserve.layers import linear, quant_linear
from radixserve.layers.linear import Linear, QKVLinear
from radixserve.layers.quant_linear import Int4Matmul, Int4Weight, Int8Matmul, Int8Weight, kernel_available
from radixserve.weights.gguf_blocks import decode_int4

ROWS, COLS = 48, 512


def gguf_blocks(type_name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks (ROWS, bytes per row), gguf's fp32 dequantization (ROWS, COLS)). Q4_0 and
    Q4_1 come from `gguf.quants.quantize` of a random weight; gguf-py cannot quantize Q4_K, so
    its blocks are random bytes with small positive fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        raw = rng.integers(0, 256, (ROWS, COLS // 256, 144), dtype=np.uint8)
        raw[..., 0:2] = (rng.random((ROWS, COLS // 256, 1)) * 0.02).astype(np.float16).view(np.uint8)
        raw[..., 2:4] = (rng.random((ROWS, COLS // 256, 1)) * 0.02).astype(np.float16).view(np.uint8)
        raw = raw.reshape(ROWS, -1)
    else:
        raw = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), kind)
    return raw, dequantize(raw, kind)


def int4_weight(type_name: str, seed: int = 0) -> tuple[Int4Weight, torch.Tensor]:
    raw, ref = gguf_blocks(type_name, seed)
    return Int4Weight(*(torch.from_numpy(a) for a in decode_int4(type_name, raw, COLS))), torch.from_numpy(ref)


def bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bound of |x @ w.T - kernel| when x, the dequantized weight and the output are rounded
    to bf16 (unit roundoff 2^-9 each): (2 * 2^-9 + 2^-9) * |x| @ |w|.T, doubled for slack."""
    return 6 * 2.0 ** -9 * (x.abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_blocks_decode_exactly(type_name):
    """Equal to gguf's dequantization up to fp32 rounding of the rewritten formula
    ((q - 8) * scale + zero instead of d * q + m): a few ulps of 8 |scale| + |zero|."""
    weight, ref = int4_weight(type_name)
    assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    size = (8 * weight.scale.abs() + weight.zero.abs()).repeat_interleave(32, dim=1)
    assert ((weight.dequantize() - ref).abs() <= 4 * torch.finfo(torch.float32).eps * size).all()
    if type_name == "Q4_0":
        assert torch.equal(weight.dequantize(), ref)      # zero = 0: nothing rewritten


def test_decode_rejects_other_types_and_bad_rows():
    raw, _ = gguf_blocks("Q4_0")
    with pytest.raises(ValueError, match="no int4 mapping"):
        decode_int4("Q8_0", raw, COLS)
    with pytest.raises(ValueError, match="bytes per row"):
        decode_int4("Q4_1", raw, COLS)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_int4_kernel_reproduces_gguf_weights(type_name, num_tokens):
    assert kernel_available(Int4Weight)
    weight, ref = int4_weight(type_name)
    x = torch.randn(num_tokens, COLS, generator=torch.Generator().manual_seed(num_tokens))
    got = Int4Matmul([weight])(x)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, ROWS)
    assert ((got - x @ ref.t()).abs() <= bf16_bound(x, ref)).all()


def test_int4_fused_shards_equal_one_weight():
    a, ref_a = int4_weight("Q4_1", seed=1)
    b, ref_b = int4_weight("Q4_0", seed=2)
    x = torch.randn(4, COLS)
    fused = Int4Matmul([a, b])(x)
    assert torch.equal(fused[:, :ROWS], Int4Matmul([a])(x)) and torch.equal(fused[:, ROWS:], Int4Matmul([b])(x))
    ref = torch.cat([ref_a, ref_b])
    assert ((fused - x @ ref.t()).abs() <= bf16_bound(x, ref)).all()
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Matmul([a.take_rows(torch.arange(8))])


def test_int8_requantization_bound_and_kernel():
    assert kernel_available(Int8Weight)
    w = torch.randn(ROWS, COLS)
    q = Int8Weight.from_float(w)
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()   # half a step per row
    x = torch.randn(7, COLS)
    ref = q.dequantize()
    assert ((Int8Matmul([q])(x) - x @ ref.t()).abs() <= bf16_bound(x, ref)).all()


def _qkv_layer() -> tuple[QKVLinear, dict[str, Int4Weight], torch.Tensor]:
    """A fused QKV layer (512 columns; rows q 48, k 16, v 16) and its three int4 shards."""
    layer = QKVLinear(COLS, num_heads=3, num_kv_heads=1, head_dim=16)
    shards = {}
    for i, (name, (_, rows)) in enumerate(layer.shards.items()):
        w, _ = int4_weight("Q4_1", seed=10 + i)
        shards[name] = w.take_rows(torch.arange(rows))
    ref = torch.cat([shards[n].dequantize() for n in layer.shards])
    return layer, shards, ref


def test_linear_runs_quantized_shards_on_the_kernel():
    layer, shards, ref = _qkv_layer()
    for name, w in shards.items():
        layer.load(w, name)
    layer.prepare()
    assert layer.weight.numel() == 0, "a quantized layer keeps no float weight"
    x = torch.randn(3, COLS)
    assert ((layer(x) - x @ ref.t()).abs() <= bf16_bound(x, ref)).all()


@pytest.mark.parametrize("native", [False, True])
def test_quantized_max_tokens_runs_larger_inputs_on_the_dequantized_weight(native, monkeypatch):
    """--quantized-max-tokens 4: up to 4 rows on the int4 kernel (bf16 bound, not fp32-exact),
    more rows on the dequantization: fp32 (fp32 GEMM rounding only), or a bf16 copy where the
    CPU multiplies bf16 natively (the kernel's own bf16 bound)."""
    if native and not quant_linear.native_bf16():
        pytest.skip("no native bf16 on this CPU")
    monkeypatch.setattr(linear, "native_bf16", lambda: native)
    layer, shards, ref = _qkv_layer()
    for name, w in shards.items():
        layer.load(w, name)
    layer.prepare(quantized_max_tokens=4)
    assert layer._packed_dtype == (torch.bfloat16 if native else torch.float32)
    calls = []
    kernel = layer._quant
    layer._quant = lambda x, cast_back=True: calls.append(x.shape[0]) or kernel(x, cast_back)
    for m in (1, 4, 5, 16):
        x = torch.randn(m, COLS)
        got = layer(x)
        assert got.dtype == torch.float32
        err = (got - x @ ref.t()).abs()
        assert (err <= bf16_bound(x, ref)).all(), m
        if m > 4 and not native:
            assert (err <= 1e-4 * (x.abs() @ ref.abs().t())).all(), m   # fp32, not bf16
        if m > 4 and native:
            assert err.max() > 1e-4 * float((x.abs() @ ref.abs().t()).max()), "bf16, not fp32"
    assert calls == [1, 4]


def test_cast_back_false_keeps_the_compute_dtype_and_every_path_takes_bf16_input():
    """`cast_back=False` (what the MLP asks of gate_up): a quantized layer returns the kernel's
    bf16 at small steps and its float copy's dtype at large ones, within the bf16 bound; an
    fp32 layer given bf16 input (split bmm at M = 1, packed above) returns bf16."""
    layer, shards, ref = _qkv_layer()
    for name, w in shards.items():
        layer.load(w, name)
    layer.prepare(quantized_max_tokens=4)
    for m in (1, 5):
        x = torch.randn(m, COLS)
        y = layer(x, cast_back=False)
        assert y.dtype == (torch.bfloat16 if m <= 4 else layer._packed_dtype), m
        assert ((y.float() - x @ ref.t()).abs() <= bf16_bound(x, ref)).all(), m
    plain = Linear(COLS, ROWS)
    plain.weight.data.normal_()
    plain.prepare()
    w = plain.weight.data
    for m in (1, 5):
        x = torch.randn(m, COLS).bfloat16()
        y = plain(x)
        assert y.dtype == torch.bfloat16, m
        assert ((y.float() - x.float() @ w.t()).abs() <= bf16_bound(x.float(), w)).all(), m


def test_linear_falls_back_to_fp32_when_it_cannot_run_quantized(monkeypatch):
    x = torch.randn(3, COLS)
    layer, shards, ref = _qkv_layer()        # one shard plain fp32: the whole layer dequantizes
    layer.load(shards["q"], "q")
    layer.load(shards["k"], "k")
    layer.load(shards["v"].dequantize(), "v")
    layer.prepare()
    assert layer._quant is None and torch.equal(layer.weight.data, ref)
    layer, shards, ref = _qkv_layer()        # batch-invariant mode: never quantized
    for name, w in shards.items():
        layer.load(w, name)
    layer.prepare(batch_invariant=True)
    assert layer._quant is None and torch.equal(layer.weight.data, ref)
    monkeypatch.setattr(quant_linear, "kernel_available", lambda kind: False)
    monkeypatch.setattr("radixserve.layers.linear.kernel_available", lambda kind: False)
    plain = Linear(COLS, ROWS)
    w, ref = int4_weight("Q4_0")
    plain.load(w)
    plain.prepare()
    assert plain._quant is None and torch.equal(plain.weight.data, ref)
    assert torch.allclose(plain(x), x @ ref.t(), rtol=1e-4, atol=1e-4)


def test_screened_head_recomputes_its_top_in_fp32_and_keeps_larger_steps_exact():
    """enable_screened_head(4, 16): up to 4 rows are screened in int8 (bf16 activations and
    output); each row's 16 largest screened logits are then fp32's, the rest within int8's
    error; more rows run on the exact fp32 weight. Greedy picks agree with fp32."""
    gen = torch.Generator().manual_seed(3)
    layer = Linear(COLS, 4096, bias=True)
    layer.weight.data.copy_(torch.randn(4096, COLS, generator=gen))
    layer.bias.data.copy_(torch.randn(4096, generator=gen))
    layer.prepare()
    w, b = layer.weight.data, layer.bias.data
    assert layer.enable_screened_head(4, 16)
    for m in (1, 4, 5, 16):
        x = torch.randn(m, COLS, generator=gen)
        ref = x @ w.t() + b
        scale = x.abs() @ w.abs().t() + b.abs()
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        exact = (got - ref).abs() <= 1e-5 * scale
        if m <= 4:
            assert int(exact.sum(1).min()) >= 16 and not exact.all(), "the top only is recomputed"
            top = ref.topk(16).indices
            assert exact.gather(1, top[:, :8]).all(), "fp32's largest logits are exact"
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            # int8 per row (scale max|row| / 127), bf16 activations and output.
            assert ((got - ref).abs() <= 2 ** -6 * scale).all(), m
        else:
            assert exact.all(), m


def test_screened_head_is_refused_without_an_int8_kernel_or_an_fp32_weight(monkeypatch):
    from radixserve.layers import linear

    layer = Linear(COLS, ROWS)
    layer.weight.data.normal_()
    layer.prepare()
    monkeypatch.setattr(linear, "kernel_available", lambda kind: False)
    assert layer.enable_screened_head(4, 8) is False
    monkeypatch.undo()
    half = Linear(COLS, ROWS).to(torch.bfloat16)
    half.prepare()
    assert half.enable_screened_head(4, 8) is False
    x = torch.randn(2, COLS)
    assert torch.allclose(layer(x), x @ layer.weight.data.t(), rtol=1e-4, atol=1e-4)
