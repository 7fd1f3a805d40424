"""radixserve::int4_int8_mm (radixserve/csrc/int4_int8.cpp): every ISA path this CPU runs equals the torch reference
bit for bit, rows are batch-invariant, the reference is within int8 activation rounding of the dequantized matmul,
and the default model's GGUF Q4_1 blocks round-trip into (d, mn) exactly."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixserve.layers import int4_int8 as ii
from radixserve.layers.quant_linear import Int4Weight

SHAPES = [(1, 32, 1), (2, 96, 17), (7, 64, 45), (33, 576, 31), (40, 160, 33)]


def random_weight(n: int, k: int, gen: torch.Generator, f16: bool = False) -> Int4Weight:
    """f16: d and m are fp16 values (as in Q4_0 / Q4_1), so the kernel reads fp16 scales."""
    d, m = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3, torch.randn(n, k // 32, generator=gen) * 0.05
    if f16:
        d, m = d.half().float(), m.half().float()
    return Int4Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, m + 8 * d)


def random_x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, :32] = 0   # an all-zero block
    if m > 1:   # exact halves after scaling by 127 / amax = 1: round half to even
        x[1, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)
    return x


def reference(w: Int4Weight, x: torch.Tensor) -> torch.Tensor:
    return ii.reference_mm(x, w.codes, *ii.block_params(w.scale, w.zero))


def kernel_isas() -> list[str]:
    return list(ii.supported_isas())


def test_reference_rounds_half_to_even():
    q8, dx, sxf = ii.quantize_rows(random_x(2, 32, torch.Generator().manual_seed(0)))
    assert q8[1, 0, :6].tolist() == [127, 2, -4, 0, -0, 2]
    assert q8[0].abs().sum() == 0 and dx[0, 0] == 0 and sxf[0, 0] == 0
    assert dx[1, 0] == torch.tensor(127.0) / 127 and sxf[1, 0] == dx[1, 0] * 127


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_reference_is_the_dequantized_matmul_within_activation_rounding(m, k, n):
    gen = torch.Generator().manual_seed(m * k + n)
    w, x = random_weight(n, k, gen), random_x(m, k, gen)
    wf = w.dequantize().double()
    exact = x.double() @ wf.t()
    _, dx, _ = ii.quantize_rows(x)
    # |x - dx * q8| <= dx / 2 per element; float combination error is far below that
    bound = (dx.double().repeat_interleave(32, dim=1) / 2) @ wf.abs().t() + 1e-5 * (x.double().abs() @ wf.abs().t())
    err = (reference(w, x).double() - exact).abs()
    assert bool((err <= bound + 1e-6).all()), float((err - bound).max())


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_path_equals_the_reference_bitwise(m, k, n, f16):
    if not kernel_isas():
        pytest.skip("radixserve/csrc not built (python -m radixserve.csrc.build)")
    gen = torch.Generator().manual_seed(1000 + m * k + n)
    w, x = random_weight(n, k, gen, f16), random_x(m, k, gen)
    ref = reference(w, x)
    for isa in kernel_isas():
        mm = ii.Int4Int8Matmul([w], isa=isa)
        assert mm.scales.dtype == (torch.float16 if f16 else torch.float32)
        got = mm(x)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.equal(got, ref), f"{isa}: max |diff| {float((got - ref).abs().max())}"


@pytest.mark.parametrize("isa", [None, *ii.ISAS])
def test_rows_are_batch_invariant(isa):
    if isa is not None and isa not in kernel_isas():
        pytest.skip(f"{isa} not available here")
    gen = torch.Generator().manual_seed(7)
    w, x = random_weight(45, 192, gen), random_x(37, 192, gen)
    mm = ii.Int4Int8Matmul([w], isa=isa)
    full = mm(x)
    for i in range(x.shape[0]):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1]), f"row {i}"
    assert torch.equal(mm(x[5:30]), full[5:30])


def test_shards_stack_and_bf16_input_casts_back():
    gen = torch.Generator().manual_seed(3)
    a, b, x = random_weight(20, 64, gen), random_weight(13, 64, gen), random_x(3, 64, gen)
    both = Int4Weight(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in ("codes", "scale", "zero")))
    for isa in [None, *kernel_isas()]:
        mm = ii.Int4Int8Matmul([a, b], isa=isa)
        assert torch.equal(mm(x), reference(both, x))
        assert mm(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ii.Int4Int8Matmul([a, random_weight(4, 96, gen)])


def test_forced_isa_from_the_environment(monkeypatch):
    monkeypatch.setenv(ii.ISA_ENV, "scalar")
    ii.chosen_isa.cache_clear()
    try:
        assert ii.chosen_isa() == ("scalar" if kernel_isas() else None)
    finally:
        ii.chosen_isa.cache_clear()


def test_default_model_q4_1_blocks_round_trip():
    """d and mn (w = d * q + mn) recovered from the Int4Weight form are the GGUF's own f16 d and m, bit for bit."""
    from radixserve.weights.gguf_blocks import decode_int4
    from radixserve.weights.paths import resolve_model_path
    gguf = pytest.importorskip("gguf")
    path = resolve_model_path(None)
    assert os.path.isfile(path)
    tensors = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type.name == "Q4_1"]
    assert len(tensors) >= 100
    for t in tensors[:: max(1, len(tensors) // 12)]:
        rows = np.asarray(t.data)[:64]
        blocks = rows.reshape(rows.shape[0], -1, 20)
        d16 = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m16 = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes, scale, zero = (torch.from_numpy(a) for a in decode_int4("Q4_1", rows, int(t.shape[0])))
        d, mn = ii.block_params(scale, zero)
        assert torch.equal(d, torch.from_numpy(d16)) and torch.equal(mn, torch.from_numpy(m16)), t.name
        ggml = torch.from_numpy(gguf.quants.dequantize(rows, t.tensor_type).astype(np.float32))
        ours = codes.float() * d.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1)
        assert torch.equal(ours, ggml), t.name


def test_linear_runs_int4_int8_weights_on_the_kernel_even_when_batch_invariant():
    from radixserve.layers.linear import Linear
    from radixserve.layers.quant_linear import Int4Int8Weight
    gen = torch.Generator().manual_seed(11)
    w, x = random_weight(33, 64, gen), random_x(5, 64, gen)
    layer = Linear(64, 33)
    layer.load(Int4Int8Weight(w.codes, w.scale, w.zero))
    layer.prepare(batch_invariant=True)
    assert layer.quantized
    assert torch.equal(layer(x), reference(w, x))
