"""radixserve::decode_attention (csrc/decode_attention.cpp) against SDPA with the length mask, on every path this CPU
runs: GQA ratios, L from 1 to 2048, ragged lens, the DecodeMirror's strided views; its exp against torch.exp."""
from __future__ import annotations

import math

import pytest
import torch

from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.decode_mirror import decode_attention

ISAS = decode_kernel.supported_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="radixserve/csrc not built (python -m radixserve.csrc.build)")


def mirror_views(batch: int, num_kv: int, length: int, head_dim: int, gen: torch.Generator):
    """k, v (B, KV, L, D) cut from (KV, slots, capacity, D) buffers as MirrorStep.attend cuts them."""
    k, v = (torch.randn(num_kv, batch + 2, length + 37, head_dim, generator=gen) * 2 for _ in range(2))
    return k[:, :batch, :length].transpose(0, 1), v[:, :batch, :length].transpose(0, 1)


def sdpa_reference(q, k, v, lens):
    visible = torch.arange(k.shape[2])[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None]
    return decode_attention(q, k, v, mask)


def assert_within_bound(out, expected, v):
    assert out.shape == expected.shape and out.dtype == torch.float32
    error = (out - expected).abs().max().item()
    assert error <= decode_kernel.OUTPUT_TOL * v.abs().max().item(), error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("batch,heads,num_kv,head_dim", [
    (1, 9, 3, 64), (3, 8, 8, 64), (5, 12, 2, 128), (2, 16, 2, 80), (4, 4, 1, 24), (2, 6, 3, 20)])
@pytest.mark.parametrize("length", [1, 17, 320, 2048])
def test_matches_sdpa(isa, batch, heads, num_kv, head_dim, length):
    gen = torch.Generator().manual_seed(length * 131 + heads)
    q = torch.randn(batch, heads, head_dim, generator=gen) * 2
    k, v = mirror_views(batch, num_kv, length, head_dim, gen)
    lens = torch.randint(1, length + 1, (batch,), generator=gen)
    lens[0] = length
    out = decode_kernel.decode_attention_lens(q, k, v, lens, isa)
    expected = sdpa_reference(q, k, v, lens)
    assert_within_bound(out, expected, v)


@pytest.mark.parametrize("isa", ISAS)
def test_peaked_scores_and_non_contiguous_q(isa):
    """Large |q . k| (one position dominates after max subtraction) and q a strided view, as after a qkv split."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 9 + 6, 64, generator=gen) * 10
    q = qkv[:, :9]
    k, v = mirror_views(3, 3, 100, 64, gen)
    k, v = k * 5, v * 5
    lens = torch.tensor([100, 1, 63])
    out = decode_kernel.decode_attention_lens(q, k, v, lens, isa)
    expected = sdpa_reference(q, k, v, lens)
    assert_within_bound(out, expected, v)


@pytest.mark.parametrize("isa", ISAS)
def test_refuses_bad_lens_and_dtypes(isa):
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    for lens in (torch.tensor([0, 3]), torch.tensor([9, 3]), torch.tensor([1, 2, 3])):
        with pytest.raises(RuntimeError):
            decode_kernel.decode_attention_lens(q, k, v, lens, isa)
    with pytest.raises(RuntimeError):
        decode_kernel.decode_attention_lens(q.double(), k.double(), v.double(), torch.tensor([1, 2]), isa)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
def test_exp_within_its_stated_bound(isa):
    x = torch.linspace(-87.0, 0.0, 2_000_003)
    x = torch.cat([x, -torch.rand(100_000) * 1e-3, torch.tensor([0.0, -1e-30, -87.0])])
    exact = torch.exp(x.double())
    rel = ((decode_kernel.fast_exp(x, isa).double() - exact).abs() / exact).max().item()
    assert rel <= decode_kernel.EXP_REL_ERROR, rel
    assert decode_kernel.fast_exp(torch.tensor([-200.0, -math.inf]), isa).max().item() <= math.exp(-87) * 1.01


def test_op_registration_and_fake_kernel():
    """torch.library.opcheck: schema, fake kernel (shape, dtype, strides) and tracing agree with the CPU kernel."""
    q, k = torch.randn(2, 6, 32), torch.randn(2, 3, 7, 32)
    isa = decode_kernel.ISAS.index(ISAS[-1])
    results = torch.library.opcheck(torch.ops.radixserve.decode_attention.default, (q, k, k, torch.tensor([7, 2]), isa))
    assert results and set(results.values()) == {"SUCCESS"}, results


def test_runs_only_for_fp32_on_cpu():
    assert decode_kernel.runs(torch.float32, torch.device("cpu")) == (decode_kernel.chosen_isa() is not None)
    assert not decode_kernel.runs(torch.bfloat16, torch.device("cpu"))
    assert not decode_kernel.runs(torch.float32, torch.device("cuda"))
