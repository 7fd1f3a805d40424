"""radixserve::decode_attention (csrc/decode_attention.cpp) against SDPA with the length mask, on every path this CPU
runs: GQA ratios, L from 1 to 2048, ragged lens, the DecodeMirror's strided views; its exp against torch.exp; the
paged form (radixserve::decode_attention_paged) against it over shuffled pages, and its refusals."""
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


def paged_copy(k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, page_size: int, gen: torch.Generator):
    """k, v (B, KV, L, D) scattered over shuffled pages of (KV, P, page_size, D) pools of noise -> (k_pool, v_pool,
    page_table (B, M)); pages past a sequence's end stay noise and its table past them says page 0."""
    batch, num_kv, length, head_dim = k.shape
    max_pages = -(-length // page_size)
    pools = [torch.randn(num_kv, batch * max_pages + 3, page_size, head_dim, generator=gen) * 50 for _ in range(2)]
    order = torch.randperm(pools[0].shape[1], generator=gen)
    table = torch.zeros(batch, max_pages, dtype=torch.long)
    for b in range(batch):
        for i in range(-(-int(lens[b]) // page_size)):
            table[b, i] = page = int(order[b * max_pages + i])
            for pool, seq in zip(pools, (k, v)):
                rows = seq[b, :, i * page_size:(i + 1) * page_size]
                pool[:, page, :rows.shape[1]] = rows
    return pools[0], pools[1], table


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("batch,heads,num_kv,head_dim,page_size", [
    (1, 9, 3, 64, 16), (3, 8, 8, 64, 16), (5, 12, 2, 128, 1), (2, 6, 3, 20, 7)])
@pytest.mark.parametrize("length", [1, 17, 320, 1500])
def test_paged_equals_the_mirror_path(isa, batch, heads, num_kv, head_dim, page_size, length):
    """The paged op reads the same rows in the same order as decode_attention: bitwise equal, within SDPA's bound."""
    gen = torch.Generator().manual_seed(length * 7 + heads)
    q = torch.randn(batch, heads, head_dim, generator=gen) * 2
    k, v = mirror_views(batch, num_kv, length, head_dim, gen)
    lens = torch.randint(1, length + 1, (batch,), generator=gen)
    lens[-1] = length
    k_pool, v_pool, table = paged_copy(k, v, lens, page_size, gen)
    out = decode_kernel.decode_attention_paged(q, k_pool, v_pool, table, lens, isa)
    assert torch.equal(out, decode_kernel.decode_attention_lens(q, k, v, lens, isa))
    assert_within_bound(out, sdpa_reference(q, k, v, lens), v)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,num_kv,head_dim", [(9, 3, 64), (8, 2, 128), (6, 3, 20)])
@pytest.mark.parametrize("length", [1, 33, 700])
def test_paged_bf16_equals_the_mirror_path_over_its_values(isa, heads, num_kv, head_dim, length):
    """bf16 K and V pages are widened exactly: the result is bitwise the fp32 kernel's over k.float(), v.float()."""
    gen = torch.Generator().manual_seed(length + head_dim)
    q = torch.randn(2, heads, head_dim, generator=gen)
    k, v = (x.bfloat16().float() for x in mirror_views(2, num_kv, length, head_dim, gen))
    lens = torch.tensor([length, max(1, length // 3)])
    k_pool, v_pool, table = paged_copy(k, v, lens, 16, gen)
    out = decode_kernel.decode_attention_paged(q, k_pool.bfloat16(), v_pool.bfloat16(), table, lens, isa)
    assert torch.equal(out, decode_kernel.decode_attention_lens(q, k, v, lens, isa))
    with pytest.raises(RuntimeError):   # one dtype for K and V; the mirror form stays fp32-only
        decode_kernel.decode_attention_paged(q, k_pool.bfloat16(), v_pool, table, lens, isa)
    with pytest.raises(RuntimeError):
        decode_kernel.decode_attention_lens(q, k.bfloat16(), v.bfloat16(), lens, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_paged_refuses_bad_pages_and_lens(isa):
    q, pool = torch.randn(2, 4, 16), torch.randn(2, 5, 4, 16)
    table = torch.tensor([[0, 1], [2, 3]])
    decode_kernel.decode_attention_paged(q, pool, pool, table, torch.tensor([8, 5]), isa)
    for bad_table, lens in ((torch.tensor([[0, 5], [2, 3]]), torch.tensor([8, 5])),    # page 5 of 5
                            (torch.tensor([[0, -1], [2, 3]]), torch.tensor([8, 5])),
                            (table, torch.tensor([9, 5])), (table, torch.tensor([0, 5])),
                            (table.float(), torch.tensor([8, 5]))):
        with pytest.raises(RuntimeError):
            decode_kernel.decode_attention_paged(q, pool, pool, bad_table, lens, isa)
    table[0, 1] = 99   # past lens[0]'s last page: never read
    decode_kernel.decode_attention_paged(q, pool, pool, table, torch.tensor([4, 5]), isa)


def test_paged_op_registration_and_fake_kernel():
    q, pool = torch.randn(2, 6, 32), torch.randn(3, 4, 8, 32)
    isa = decode_kernel.ISAS.index(ISAS[-1])
    args = (q, pool, pool, torch.tensor([[0, 1], [3, 2]]), torch.tensor([9, 16]), isa)
    results = torch.library.opcheck(torch.ops.radixserve.decode_attention_paged.default, args)
    assert results and set(results.values()) == {"SUCCESS"}, results
