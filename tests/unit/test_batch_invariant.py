"""layers/batch_invariant.py: a row of the packed matmul has the same bits alone and inside any
batch, for the inner sizes the served models have (the default model's down projection has
K = 1536; on an AVX-512 EPYC oneDNN's M == 1 kernel for K > 1024 gave other bits than M >= 2)."""
from __future__ import annotations

import pytest
import torch

from radixserve.layers import batch_invariant as bi


@pytest.mark.parametrize("k", [64, 576, 1152, 1536, 4096])
def test_row_alone_equals_the_row_inside_every_batch(k):
    gen = torch.Generator().manual_seed(k)
    packed = bi.pack(torch.randn(96, k, generator=gen))
    rows = torch.randn(65, k, generator=gen)
    alone = bi.matmul(rows[:1], packed)
    assert alone.shape == (1, 96)
    for m in (2, 3, 17, 65):
        for pos in (0, m // 2, m - 1):
            batch = torch.cat([rows[1:1 + pos], rows[:1], rows[1 + pos:m]])
            assert torch.equal(bi.matmul(batch, packed)[pos:pos + 1], alone), (m, pos)


def test_single_row_with_bias_matches_the_batched_row():
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 2048, generator=gen), torch.randn(40, generator=gen)
    packed = bi.pack(weight)
    rows = torch.randn(4, 2048, generator=gen)
    assert torch.equal(bi.matmul(rows[:1], packed, bias), bi.matmul(rows, packed, bias)[:1])
    torch.testing.assert_close(bi.matmul(rows[:1], packed, bias), rows[:1] @ weight.T + bias, rtol=1e-4, atol=1e-4)


def test_start_up_check_refuses_a_matmul_whose_single_row_differs(monkeypatch):
    """The check passes here, and refuses a matmul that computes M == 1 apart (as oneDNN's own
    M == 1 kernel did for K > 1024 on Zen 4) once that kernel's bits differ."""
    bi.check_row_invariance(torch.float32, torch.device("cpu"))
    plain = bi.matmul

    def single_row_apart(x, packed, bias=None):
        y = plain(x, packed, bias)
        return y + 1e-3 if x.shape[0] == 1 and x.shape[1] > 1024 else y
    monkeypatch.setattr(bi, "matmul", single_row_apart)
    with pytest.raises(ValueError, match="not batch-invariant"):
        bi.check_row_invariance(torch.float32, torch.device("cpu"))
