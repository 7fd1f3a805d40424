"""C45: the (output, LSE) merge of attention parts (runner/attention/cascade.py merge_states) with empty parts:
empty + empty, empty + finite, finite + finite against one softmax over both key sets, and the +inf "empty" some
kernels report; no NaN anywhere."""
from __future__ import annotations

import torch

from radixserve.runner.attention.cascade import merge_states

INF = float("inf")


def part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (R, D) over k, v (N, D): (out (R, D), lse (R,)); N = 0 gives (0, -inf)."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], -INF)
    s = q @ k.T
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_c45_empty_plus_empty_is_empty_not_nan():
    o, lse = merge_states(torch.zeros(3, 4), torch.full((3,), -INF), torch.zeros(3, 4), torch.full((3,), -INF))
    assert torch.equal(o, torch.zeros(3, 4)) and torch.equal(lse, torch.full((3,), -INF))


def test_c45_empty_plus_finite_is_the_finite_part_exactly_either_side_and_for_plus_inf():
    torch.manual_seed(0)
    o_s, lse_s = torch.randn(5, 8), torch.randn(5) * 10
    for empty_lse in (-INF, INF):
        garbage = torch.full((5, 8), float("nan"))          # an empty row's output is whatever the kernel left
        empty = torch.full((5,), empty_lse)
        for o, lse in (merge_states(garbage, empty, o_s, lse_s), merge_states(o_s, lse_s, garbage, empty)):
            assert torch.equal(o, o_s) and torch.equal(lse, lse_s)


def test_c45_finite_parts_equal_one_softmax_over_both_and_mixed_rows_stay_finite():
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 16), torch.randn(20, 16), torch.randn(20, 16)
    o, lse = merge_states(*part(q, k[:7], v[:7]), *part(q, k[7:], v[7:]))
    whole_o, whole_lse = part(q, k, v)
    assert torch.allclose(o, whole_o, atol=1e-6) and torch.allclose(lse, whole_lse, atol=1e-5)
    # a batch whose rows are empty in one part, the other, or both (chunks of different sequences)
    lse_a, lse_b = torch.tensor([1.0, -INF, -INF, INF]), torch.tensor([-INF, 2.0, -INF, -INF])
    o, lse = merge_states(torch.ones(4, 2), lse_a, torch.full((4, 2), 3.0), lse_b)
    assert torch.equal(o, torch.tensor([[1.0, 1.0], [3.0, 3.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(lse, torch.tensor([1.0, 2.0, -INF, -INF]))
