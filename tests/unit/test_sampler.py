"""Sampler: penalties, min-tokens masking, top-k / top-p / min-p, seeded determinism, raw logprobs (C18)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixserve.layers.sampler import Sampler, step_seed, token_logprobs
from radixserve.sampling_params import SamplingParams

V = 16
EOS = 2


@dataclass
class Row:
    params: SamplingParams
    seed: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    min_tokens_left: int = 0


def sampler() -> Sampler:
    return Sampler(V, frozenset({EOS}))


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs + [0.0] * (V - len(probs)), dtype=torch.float32)
    return torch.log(p.clamp_min(1e-30))[None]


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 300, **row) -> set[int]:
    s = sampler()
    return {s.sample(logits, [Row(params, seed=i, **row)])[0] for i in range(n)}


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    rows = [Row(SamplingParams(temperature=0, logprobs=3)) for _ in range(3)]
    s = sampler()
    ids = s.sample(logits, rows)
    out = s.logprobs(logits, ids, rows)
    ref = torch.log_softmax(logits, -1)
    for i, o in enumerate(out):
        assert o.token_id == ids[i] == int(logits[i].argmax())
        assert o.logprob == pytest.approx(float(ref[i].max()), abs=1e-6)
        assert [t for t, _ in o.top] == torch.topk(ref[i], 3).indices.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.5, -1.0
    # 3 is seen in the prompt: 2.0 / 2 = 1.0 < 1.5, so 4 wins greedily.
    row = Row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[3, 5])
    assert sampler().sample(logits, [row])[0] == 4
    x = sampler()._penalised(logits, [row])
    assert float(x[0, 3]) == 1.0 and float(x[0, 5]) == -2.0 and float(x[0, 4]) == 1.5


def test_logit_bias_steers_greedy_and_sampling_but_not_logprobs():
    logits = logits_from_probs([0.7, 0.2, 0.1])
    forced = SamplingParams(temperature=0, logprobs=1, logit_bias={2: 100.0})
    s = sampler()
    (out,) = s.logprobs(logits, s.sample(logits, [Row(forced)]), [Row(forced)])
    assert out.token_id == 2
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]), abs=1e-6)   # raw
    banned = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0})
    assert draws(logits, banned) == {2}
    assert len(draws(logits, SamplingParams(temperature=1.0))) == 3


@pytest.mark.parametrize("bias, message", [
    ({V: 1.0}, "invalid token id"), ({-1: 1.0}, "invalid token id"), ({3: 100.5}, "in \\[-100, 100\\]"),
    ({3: float("nan")}, "finite"), ({i: 1.0 for i in range(1025)}, "at most 1024"),
])
def test_logit_bias_out_of_range_is_invalid(bias, message):
    from radixserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(logit_bias=bias).validate(V)


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.zeros(1, V)
    row = Row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              prompt_ids=[7], output_ids=[3, 3, 4])
    x = sampler()._penalised(logits, [row])
    assert float(x[0, 3]) == pytest.approx(-(2 * 0.5 + 0.25))
    assert float(x[0, 4]) == pytest.approx(-(0.5 + 0.25))
    assert float(x[0, 7]) == 0.0  # prompt tokens carry no frequency/presence penalty
    assert float(logits.abs().sum()) == 0.0  # raw logits untouched


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS], logits[0, 9], logits[0, 1] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0, stop_token_ids=[9], ignore_eos=True)
    assert sampler().sample(logits, [Row(params, min_tokens_left=1)])[0] == 1
    assert sampler().sample(logits, [Row(params, min_tokens_left=0)])[0] == EOS


def test_top_k_top_p_min_p_masks():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert draws(logits, SamplingParams(top_k=2)) == {0, 1}
    assert draws(logits, SamplingParams(top_p=0.65)) == {0, 1}      # 0.4 < 0.65 <= 0.7
    assert draws(logits, SamplingParams(top_p=0.71)) == {0, 1, 2}
    assert draws(logits, SamplingParams(min_p=0.45)) == {0, 1, 2}   # p >= 0.18
    assert draws(logits, SamplingParams(min_p=0.6)) == {0, 1}
    assert draws(logits, SamplingParams()) == {0, 1, 2, 3}
    assert draws(logits, SamplingParams(top_k=3, top_p=0.5)) == {0, 1}


def test_seeded_rows_do_not_depend_on_batch_composition():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen) * 2
    rows = [Row(SamplingParams(temperature=1.0, top_p=0.9, top_k=8 if i % 2 else -1),
                seed=100 + i, output_ids=[1] * i) for i in range(6)]
    full = sampler().sample(logits, rows)
    alone = [sampler().sample(logits[i:i + 1], [rows[i]])[0] for i in range(6)]
    rev = sampler().sample(logits.flip(0), rows[::-1])[::-1]
    mixed = sampler().sample(torch.cat([logits[2:3], logits[0:1]]),
                             [Row(SamplingParams(temperature=0)), rows[0]])
    assert full == alone == rev
    assert mixed[1] == full[0]


def test_seed_and_step_change_the_draw():
    logits = torch.zeros(1, V)  # uniform
    params = SamplingParams(temperature=1.0)
    by_seed = {sampler().sample(logits, [Row(params, seed=s)])[0] for s in range(64)}
    by_step = {sampler().sample(logits, [Row(params, seed=1, output_ids=[0] * n)])[0]
               for n in range(64)}
    assert len(by_seed) > 8 and len(by_step) > 8
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 0)


def test_sampling_follows_the_distribution():
    logits = logits_from_probs([0.7, 0.2, 0.1])
    s = sampler()
    counts = torch.zeros(V)
    for i in range(2000):
        counts[s.sample(logits, [Row(SamplingParams(), seed=i)])[0]] += 1
    assert torch.allclose(counts[:3] / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logprobs_not_truncated_by_top_p_or_top_k():
    """Field case C18: top-p/top-k change which token is drawn, never the reported logprobs."""
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    ref = torch.log_softmax(logits[0], -1)
    params = SamplingParams(temperature=0.5, top_p=0.5, top_k=2, logprobs=4)
    s = sampler()
    (out,) = s.logprobs(logits, s.sample(logits, [Row(params, seed=3)]), [Row(params, seed=3)])
    assert out.token_id == 0
    assert out.logprob == pytest.approx(float(ref[0]), abs=1e-6)
    assert [t for t, _ in out.top] == [0, 1, 2, 3]
    assert [lp for _, lp in out.top] == pytest.approx(ref[:4].tolist(), abs=1e-6)
    assert all(lp > -10 for _, lp in out.top)  # no -inf from the filters


def test_token_logprobs_helper():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0, 5, 9, 15])
    out = token_logprobs(logits, ids, 2)
    ref = torch.log_softmax(logits, -1)
    for i, o in enumerate(out):
        assert o.token_id == int(ids[i]) and o.logprob == pytest.approx(float(ref[i, ids[i]]), abs=1e-6)
        assert len(o.top) == 2 and o.top[0][0] == int(ref[i].argmax())
    assert token_logprobs(logits, ids, 0)[0].top == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=6, frequency_penalty=1.5, min_tokens=3),
    SamplingParams(temperature=0, repetition_penalty=1.3)], ids=["plain", "filtered", "greedy"])
def test_verify_emits_the_ordinary_steps_tokens_whatever_the_draft(params):
    """Issue 41 item 6: with any draft (the true tokens, a true prefix then a wrong token, random
    tokens), verify emits exactly the first j + 1 tokens of k + 1 ordinary steps, j being where the
    draft first differs from them: row i sees the draft before it (penalties, min_tokens) and draws
    with the (seed, position) of step i."""
    gen = torch.Generator().manual_seed(4)
    s, k, accepted_total = sampler(), 4, 0
    for seed in range(60):
        logits = torch.randn(k + 1, V, generator=gen) * 2
        start = Row(params, seed=seed, prompt_ids=[3, 4], output_ids=[5, 6],
                    min_tokens_left=max(params.min_tokens - 2, 0))
        steps: list[int] = []
        for i in range(k + 1):
            row = Row(params, seed=seed, prompt_ids=[3, 4], output_ids=[5, 6] + steps,
                      min_tokens_left=max(start.min_tokens_left - i, 0))
            steps.append(s.sample(logits[i:i + 1], [row])[0])
        wrong = (steps[1] + 1) % V
        drafts = [steps[:k], steps[:1] + [wrong] + steps[2:k],
                  torch.randint(0, V, (k,), generator=gen).tolist()]
        for draft in drafts:
            ids, lps = s.verify(logits, start, draft)
            j = next((i for i in range(k) if draft[i] != steps[i]), k)
            assert ids == steps[:j + 1], (seed, draft, steps)
            accepted_total += len(ids) - 1
            assert (lps is None) == (not params.wants_logprobs)
            if params.logprobs:
                ref = torch.log_softmax(logits[j], -1)[ids[-1]]
                assert [t.token_id for t in lps] == ids
                assert lps[-1].logprob == pytest.approx(float(ref), abs=1e-6) and len(lps[-1].top) == 2
    assert accepted_total > 60 * (k + 1)   # the true drafts alone keep k each
