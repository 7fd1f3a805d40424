"""The sampler under extreme but valid parameters (issue 11, finding 2): never NaN, never a
token outside what the processed distribution gives probability, greedy in the T -> 0 limit."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from radixserve.errors import InvalidRequest
from radixserve.layers.sampler import Sampler, _processed, finite_or_masked
from radixserve.sampling_params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams
from tests.unit.test_sampler import Row

V = 64
EOS = 2
# float32 softmax gives a token probability > 0 only above exp(-103.97) (the smallest subnormal):
# a drawn token's log-probability under the processed distribution must be above this.
MIN_LOGPROB = -104.0




def processed_logprobs(s: Sampler, logits: torch.Tensor, row: Row) -> torch.Tensor:
    """(V,) float64 log-probabilities of the distribution the sampler draws `row` from."""
    x = finite_or_masked(s._penalised(logits, [row]))
    return torch.log_softmax(_processed(x, [row]).double(), dim=-1)[0]


def greedy_token(s: Sampler, logits: torch.Tensor, row: Row) -> int:
    return int(finite_or_masked(s._penalised(logits, [row])).argmax())


def extreme_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Floats in [lo, hi], with the edges and log-uniform magnitudes well represented."""
    log_uniform = st.floats(math.log10(lo), math.log10(hi)).map(lambda e: min(max(10.0 ** e, lo), hi))
    return st.sampled_from([lo, hi]) | log_uniform | st.floats(lo, hi)


PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.just(4),
    temperature=extreme_floats(1e-38, 100.0),
    top_p=extreme_floats(1e-300, 1.0),
    top_k=st.sampled_from([-1, 1, 2, 5, V - 1, V, 2**31 - 1]),
    min_p=st.just(0.0) | extreme_floats(1e-300, 1.0),
    repetition_penalty=st.just(1.0) | extreme_floats(MIN_REPETITION_PENALTY, 10.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    presence_penalty=st.floats(-2.0, 2.0),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=3).map(tuple),
)


@st.composite
def logits_rows(draw) -> torch.Tensor:
    """(1, V) fp32 logits: random at a scale from 1e-3 to 1e30, some entries -inf, maybe ties."""
    scale = draw(extreme_floats(1e-3, 1e30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(1, V, generator=gen) * scale
    for i in draw(st.lists(st.integers(0, V - 1), max_size=V - 1)):
        x[0, i] = float("-inf")
    if draw(st.booleans()):
        x[0, draw(st.integers(0, V - 1))] = x.max()        # a tie for the maximum
    return x


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(logits=logits_rows(), params=PARAMS, seed=st.integers(-2**63, 2**63 - 1),
       history=st.lists(st.integers(0, V - 1), max_size=8), min_tokens_left=st.integers(0, 1))
def test_sampled_token_has_finite_non_negligible_probability(logits, params, seed, history,
                                                             min_tokens_left):
    params.validate(V)
    assume(bool(torch.isfinite(logits).any()))
    s = Sampler(V, frozenset({EOS}))
    row = Row(params, seed, prompt_ids=history[:4], output_ids=history[4:],
              min_tokens_left=min_tokens_left)
    penalised = finite_or_masked(s._penalised(logits, [row]))[0]
    assume(bool(torch.isfinite(penalised).any()))  # min-tokens masked every finite logit
    token = s.sample(logits, [row])[0]
    assert 0 <= token < V and math.isfinite(penalised[token])
    if params.is_greedy:   # T below MIN_TEMPERATURE included: the T -> 0 limit
        assert token == greedy_token(s, logits, row)
    else:
        lp = processed_logprobs(s, logits, row)
        assert math.isfinite(lp[token]) and lp[token] > MIN_LOGPROB, (token, lp[token], params)


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-10, MIN_TEMPERATURE / 2, 0.0])
def test_tiny_temperatures_are_greedy(temperature):
    """The issue's T=1e-38 drew the last vocabulary id; the T -> 0 limit is the argmax."""
    logits = torch.linspace(-5, 5, V)[None].roll(-20, dims=1)    # argmax in the middle
    assert SamplingParams(temperature=temperature).is_greedy
    for seed in range(20):
        token = Sampler(V, frozenset()).sample(logits, [Row(SamplingParams(temperature=temperature),
                                                             seed)])[0]
        assert token == int(logits.argmax()) != V - 1


def test_vanishing_top_p_keeps_the_most_likely_token():
    """top_p 1e-300 is 0 in float32: it used to mask every token and draw the last id."""
    logits = torch.linspace(-5, 5, V)[None].roll(-20, dims=1)
    for seed in range(20):
        row = Row(SamplingParams(temperature=1.0, top_p=1e-300), seed)
        assert Sampler(V, frozenset()).sample(logits, [row])[0] == int(logits.argmax())


def test_repetition_penalty_float32_cannot_hold_is_rejected():
    with pytest.raises(InvalidRequest, match="float32") as err:
        SamplingParams(repetition_penalty=1e-300).validate(V)
    assert err.value.param == "repetition_penalty"
    SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY).validate(V)


def test_smallest_repetition_penalty_saturates_instead_of_nan():
    """Dividing positive seen logits by ~1e-38 overflows to inf: saturated, not NaN; the draw
    stays among the seen tokens with positive logits."""
    logits = torch.linspace(-5, 5, V)[None]
    seen = [10, 50, 60, 63]                      # 10 has a negative logit, the others positive
    for seed in range(20):
        row = Row(SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY), seed, prompt_ids=seen)
        assert Sampler(V, frozenset()).sample(logits, [row])[0] in (50, 60, 63)


def test_nan_logits_are_never_drawn():
    logits = torch.full((1, V), float("nan"))
    logits[0, 7] = 0.0
    for seed in range(10):
        assert Sampler(V, frozenset()).sample(logits, [Row(SamplingParams(), seed)])[0] == 7


@pytest.mark.parametrize("bad", [None, "nan", "+inf", "all -inf"])
def test_one_pass_greedy_batch_equals_the_general_path(bad):
    """An all-greedy batch takes one `max` over the raw logits; a NaN, +inf or fully masked row
    anywhere in it sends the whole batch through the copy-and-mask path, so the tokens are
    always those of finite_or_masked(...).argmax (ties: the first index)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, V, generator=gen)
    logits[1, 9] = logits[1, 40] = logits[1].max() + 1          # a tie: the first index wins
    if bad == "nan":
        logits[3, 11] = float("nan")
    elif bad == "+inf":
        logits[3, 12] = float("inf")
    elif bad == "all -inf":
        logits[3] = float("-inf")
    s = Sampler(V, frozenset({EOS}))
    rows = [Row(SamplingParams(temperature=0.0), i) for i in range(6)]
    assert (s._plain_greedy(logits, rows) is None) == (bad is not None)
    tokens = s.sample(logits, rows)
    assert tokens == finite_or_masked(logits).argmax(dim=-1).tolist()
    assert tokens[1] == 9
