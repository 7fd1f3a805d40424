"""radixserve::q8_fp32_mm (radixserve/csrc/q8_fp32.cpp): every ISA path this CPU runs equals the torch reference bit
for bit, rows are batch-invariant, the result is within fp32 rounding of the dequantized matmul, the Q8_0 grid found
in an fp32 weight is the default model's own token_embd blocks, and the LM head's wiring."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.layers import q8_fp32 as q8
from tests.unit.test_int4_int8_mm import random_x

# (K, N): N not a multiple of 16 (the last column group padded)
SHAPES = [(32, 1), (96, 17), (576, 45), (64, 16)]
ROWS = [1, 2, 3, 17]


def random_q8(n: int, k: int, gen: torch.Generator, f16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) int8 with a +-127 in every block (as ggml's quantizer), d (N, K / 32) fp32 (fp16-exact if f16)."""
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[:, ::32] = 127 * (1 - 2 * torch.randint(0, 2, (n, k // 32), generator=gen, dtype=torch.int8))
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4
    return codes, (d.half().float() if f16 else d)


def dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (codes.float().view(codes.shape[0], -1, 32) * d[..., None]).view(codes.shape)


def kernel_isas() -> list[str]:
    return list(q8.supported_isas())


def fp32_bound(codes: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B + 16) * 2^-24 * |x| @ |W|.T: each d * dot passes at most 12 roundings inside its block and B over blocks."""
    return (d.shape[1] + 16) * 2.0 ** -24 * (x.double().abs() @ dequantize(codes, d).double().abs().t())


@pytest.mark.parametrize("k,n", SHAPES)
def test_reference_is_the_dequantized_matmul_within_fp32_rounding(k, n):
    gen = torch.Generator().manual_seed(k + n)
    (codes, d), x = random_q8(n, k, gen), random_x(17, k, gen)
    err = (q8.reference_mm(x, codes, d).double() - x.double() @ dequantize(codes, d).double().t()).abs()
    assert bool((err <= fp32_bound(codes, d, x)).all())


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_path_equals_the_reference_bitwise(k, n, f16):
    if not kernel_isas():
        pytest.skip("radixserve/csrc not built (python -m radixserve.csrc.build)")
    gen = torch.Generator().manual_seed(1000 + k + n)
    codes, d = random_q8(n, k, gen, f16)
    for m in ROWS:
        x = random_x(m, k, gen)
        ref = q8.reference_mm(x, codes, d)
        for isa in kernel_isas():
            mm = q8.Q8F32Matmul(codes, d, isa=isa)
            assert mm.scales.dtype == (torch.float16 if f16 else torch.float32)
            got = mm(x)
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert torch.equal(got, ref), f"{isa} M={m}: max |diff| {float((got - ref).abs().max())}"


@pytest.mark.parametrize("isa", [None, *q8.ISAS])
def test_rows_are_batch_invariant(isa):
    if isa is not None and isa not in kernel_isas():
        pytest.skip(f"{isa} not available here")
    gen = torch.Generator().manual_seed(7)
    (codes, d), x = random_q8(45, 192, gen), random_x(70, 192, gen)   # 70 rows: tiles of 32, 32 and 6
    mm = q8.Q8F32Matmul(codes, d, isa=isa)
    full = mm(x)
    for i in range(x.shape[0]):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1]), f"row {i}"
    assert torch.equal(mm(x[5:30]), full[5:30]) and torch.equal(mm(x[31:34]), full[31:34])


def test_q8_0_grid_is_found_exactly_or_refused():
    gen = torch.Generator().manual_seed(3)
    codes, d = random_q8(40, 96, gen)
    d[0, 1] = 0
    codes[0, 32:64] = 0   # an all-zero block
    found = q8.q8_0_blocks(dequantize(codes, d))
    assert found is not None and torch.equal(found[0], codes) and torch.equal(found[1], d)
    assert q8.q8_0_blocks(torch.randn(40, 96)) is None
    assert q8.q8_0_blocks(dequantize(codes, d)[:, :80]) is None   # K not a multiple of 32


def test_default_model_token_embd_is_its_gguf_q8_0_blocks():
    """The default model's Q8_0 token_embd, dequantized by gguf-py (what the loader keeps), gives back its codes and
    fp16 scales bit for bit; the kernel over them is within the fp32 bound of x @ W.T."""
    from radixserve.weights.paths import resolve_model_path
    gguf = pytest.importorskip("gguf")
    t = next(t for t in gguf.GGUFReader(resolve_model_path(None)).tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    raw = np.asarray(t.data)[::97]   # (rows, 18 blocks x 34 bytes): fp16 d, then 32 int8 codes
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1))
    w = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32))
    found = q8.q8_0_blocks(w)
    assert found is not None and torch.equal(found[0], codes) and torch.equal(found[1], d)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(5))
    got = q8.Q8F32Matmul(*found)(x)
    assert bool(((got.double() - x.double() @ w.double().t()).abs() <= fp32_bound(codes, d, x)).all())


def test_linear_head_runs_q8_up_to_its_rows_and_refuses_other_weights():
    from radixserve.layers.linear import Linear
    if not set(kernel_isas()) & set(q8.VECTOR_ISAS):
        pytest.skip("no q8_fp32 vector path here")
    gen = torch.Generator().manual_seed(11)
    codes, d = random_q8(50, 64, gen)
    head = Linear(64, 50)
    head.weight.data.copy_(dequantize(codes, d))
    head.prepare()
    assert head.enable_q8_head(4)
    x = random_x(6, 64, gen)
    assert torch.equal(head(x[:4]), q8.reference_mm(x[:4], codes, d))
    exact = x.double() @ dequantize(codes, d).double().t()
    assert float((head(x).double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())   # 6 rows: fp32 path
    other = Linear(64, 50)
    other.weight.data.normal_(generator=gen)
    other.prepare()
    assert not other.enable_q8_head(4)
