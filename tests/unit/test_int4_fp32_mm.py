"""radixserve::int4_fp32_mm (radixserve/csrc/int4_fp32.cpp): every ISA path this CPU runs equals the torch reference
bit for bit, rows are batch-invariant, the result is within fp32 rounding of the dequantized matmul (on random blocks
and the default model's GGUF Q4_1 tensors), and the mode's config and Linear wiring."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.layers import int4_fp32 as fp
from radixserve.layers.int4_int8 import block_params
from radixserve.layers.quant_linear import Int4F32Weight, Int4Weight
from tests.unit.test_int4_int8_mm import random_weight, random_x

# (M, K, N): N not a multiple of 16 (the last column group padded), M across the direct (<= 2 rows) and buffered paths
SHAPES = [(1, 32, 1), (3, 96, 17), (17, 576, 45), (64, 160, 33), (2, 64, 31), (33, 192, 16)]


def reference(w: Int4Weight, x: torch.Tensor) -> torch.Tensor:
    return fp.reference_mm(x, w.codes, *block_params(w.scale, w.zero))


def kernel_isas() -> list[str]:
    return list(fp.supported_isas())


def fp32_bound(w: Int4Weight, x: torch.Tensor) -> torch.Tensor:
    """(B + 16) * 2^-24 * sum over blocks of (|d| * sum q|x| + |mn| * sum |x|): each term of d * dot + mn * xs passes
    through at most 12 roundings inside its block and B in the running sum over blocks."""
    d, mn = block_params(w.scale, w.zero)
    nb = d.shape[1]
    w_abs = w.codes.double() * d.abs().double().repeat_interleave(32, 1) + mn.abs().double().repeat_interleave(32, 1)
    return (nb + 16) * 2.0 ** -24 * (x.double().abs() @ w_abs.t())


def test_block_sum_is_four_partial_sums_then_a_tree():
    v = torch.tensor([1.0, 2 ** -24, 0, 0] + [2 ** -24, 0, 0, 0] * 7)
    # s0 = 1 + 7 * 2^-24 term by term: each add of 2^-24 to 1 rounds back to 1 (ties to even); s1 = 2^-24
    assert fp.block_sum(v).item() == 1.0
    assert float(v.double().sum()) == 1 + 2 ** -21   # another order gives another float


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_reference_is_the_dequantized_matmul_within_fp32_rounding(m, k, n):
    gen = torch.Generator().manual_seed(m * k + n)
    w, x = random_weight(n, k, gen), random_x(m, k, gen)
    exact = x.double() @ w.dequantize().double().t()
    err = (reference(w, x).double() - exact).abs()
    assert bool((err <= fp32_bound(w, x)).all()), float((err - fp32_bound(w, x)).max())


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_path_equals_the_reference_bitwise(m, k, n, f16):
    if not kernel_isas():
        pytest.skip("radixserve/csrc not built (python -m radixserve.csrc.build)")
    gen = torch.Generator().manual_seed(1000 + m * k + n)
    w, x = random_weight(n, k, gen, f16), random_x(m, k, gen)
    ref = reference(w, x)
    for isa in kernel_isas():
        mm = fp.Int4F32Matmul([w], isa=isa)
        assert mm.scales.dtype == (torch.float16 if f16 else torch.float32)
        got = mm(x)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.equal(got, ref), f"{isa}: max |diff| {float((got - ref).abs().max())}"


@pytest.mark.parametrize("isa", [None, *fp.ISAS])
def test_rows_are_batch_invariant(isa):
    if isa is not None and isa not in kernel_isas():
        pytest.skip(f"{isa} not available here")
    gen = torch.Generator().manual_seed(7)
    w, x = random_weight(45, 192, gen), random_x(70, 192, gen)   # 70 rows: tiles of 32, 32 and 6
    mm = fp.Int4F32Matmul([w], isa=isa)
    full = mm(x)
    for i in range(x.shape[0]):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1]), f"row {i}"
    assert torch.equal(mm(x[5:30]), full[5:30]) and torch.equal(mm(x[31:33]), full[31:33])


def test_shards_stack_and_bf16_input_casts_back():
    gen = torch.Generator().manual_seed(3)
    a, b, x = random_weight(20, 64, gen), random_weight(13, 64, gen), random_x(3, 64, gen)
    both = Int4Weight(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in ("codes", "scale", "zero")))
    for isa in [None, *kernel_isas()]:
        mm = fp.Int4F32Matmul([a, b], isa=isa)
        assert torch.equal(mm(x), reference(both, x))
        assert mm(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        fp.Int4F32Matmul([a, random_weight(4, 96, gen)])


def test_forced_isa_from_the_environment(monkeypatch):
    monkeypatch.setenv(fp.ISA_ENV, "scalar")
    fp.chosen_isa.cache_clear()
    try:
        assert fp.chosen_isa() == ("scalar" if kernel_isas() else None)
    finally:
        fp.chosen_isa.cache_clear()


def test_default_model_q4_1_tensors():
    """On the default model's own Q4_1 blocks: the kernel is the reference, within the fp32 bound of x @ W.T, W
    gguf-py's dequantization."""
    from radixserve.weights.gguf_blocks import decode_int4
    from radixserve.weights.paths import resolve_model_path
    gguf = pytest.importorskip("gguf")
    path = resolve_model_path(None)
    assert os.path.isfile(path)
    tensors = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type.name == "Q4_1"]
    gen = torch.Generator().manual_seed(5)
    for t in tensors[:: max(1, len(tensors) // 4)]:
        rows = np.asarray(t.data)[:48]
        w = Int4Weight(*(torch.from_numpy(a) for a in decode_int4("Q4_1", rows, int(t.shape[0]))))
        x = torch.randn(5, w.shape[1], generator=gen)
        ggml = torch.from_numpy(gguf.quants.dequantize(rows, t.tensor_type).astype(np.float64))
        got = fp.Int4F32Matmul([w])(x)
        assert torch.equal(got, reference(w, x)), t.name
        assert bool(((got.double() - x.double() @ ggml.t()).abs() <= fp32_bound(w, x)).all()), t.name


def test_linear_runs_int4_fp32_weights_on_the_kernel_and_keeps_an_fp32_copy(monkeypatch):
    """Batch-invariant mode keeps the kernel; with --quantized-max-tokens 4 larger steps run an fp32 copy even
    where the CPU multiplies bf16 natively (numerics stay fp32-class)."""
    from radixserve.layers import linear
    gen = torch.Generator().manual_seed(11)
    w, x = random_weight(33, 64, gen), random_x(9, 64, gen)
    layer = linear.Linear(64, 33)
    layer.load(Int4F32Weight(w.codes, w.scale, w.zero))
    layer.prepare(batch_invariant=True)
    assert layer.quantized and torch.equal(layer(x), reference(w, x))
    monkeypatch.setattr(linear, "native_bf16", lambda: True)
    layer = linear.Linear(64, 33)
    layer.load(Int4F32Weight(w.codes, w.scale, w.zero))
    layer.prepare(quantized_max_tokens=4)
    assert layer.quantized and layer._packed_dtype == torch.float32
    assert torch.equal(layer(x[:4]), reference(w, x[:4]))
    exact = x.double() @ w.dequantize().double().t()
    assert float((layer(x).double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())


def test_config_allows_deterministic_but_not_with_a_float_copy():
    assert EngineConfig(quantization="int4-fp32", enable_deterministic_inference=True).quantization == "int4-fp32"
    with pytest.raises(ValueError, match="--quantized-max-tokens cannot be combined"):
        EngineConfig(quantization="int4-fp32", quantized_max_tokens=8, enable_deterministic_inference=True)


def test_a_library_built_before_an_op_was_added_leaves_that_op_on_its_reference():
    from radixserve.csrc import ops as csrc_ops
    if not kernel_isas():
        pytest.skip("radixserve/csrc not built (python -m radixserve.csrc.build)")
    assert csrc_ops.has_op("int4_fp32_mm") and not csrc_ops.has_op("int4_missing_mm")
    assert csrc_ops.supported_isas("int4_missing_mm", fp.ISAS) == ()
