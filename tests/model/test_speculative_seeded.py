"""Seeded sampling with speculation (issue 41, item 6): a seeded request's tokens are those it gets
without speculation, whatever the drafts (n-gram, with the shared table filled by earlier
requests; a full-depth and a shallower self-draft), alone and batched beside other traffic, also
under --enable-deterministic-inference.

The model's weights are drawn with std 0.5 (not 0.02): its next-token distributions are peaked
enough that at temperature 0.8 drafts are often, not always, what the target samples, so both
kept and rejected drafts occur. n-gram drafts come from the shared table: a request finds what
earlier ones generated after the same three tokens (another seed's, then its own earlier run's).
"""
from __future__ import annotations

import random

import pytest

from radixserve.sampling_params import SamplingParams
from tests.model.test_parity import make_engine
from tests.model.test_speculative import SELF_DRAFT_FULL, SELF_DRAFT_HALF, SPEC

SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
OTHER_SEED = SamplingParams(max_tokens=16, temperature=0.8, seed=70, ignore_eos=True)
ALGORITHMS = {"ngram": SPEC, "self_draft_full": SELF_DRAFT_FULL, "self_draft_half": SELF_DRAFT_HALF}


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    from tests.conftest import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("peaked"), tie_word_embeddings=False,
                            initializer_range=0.5, seed=5)


def _prompts() -> list[list[int]]:
    rng = random.Random(41)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 30, 75)]


def _traffic(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """The seeded requests beside greedy ones, other seeds and other sampling settings."""
    rng = random.Random(6)
    others = [[rng.randrange(3, 512) for _ in range(n)] for n in (12, 40, 5)]
    return ([(p, SEEDED) for p in prompts]
            + [(others[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
               (others[1], SamplingParams(max_tokens=30, temperature=0.8, seed=8, ignore_eos=True)),
               (others[2], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=9,
                                          frequency_penalty=0.5, ignore_eos=True)),
               (prompts[1], OTHER_SEED)])


def _run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Run `requests` together; their tokens, in order. Checks the page invariant every step."""
    base = engine.counters["num_finished_requests"]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"q{base}-{i}", prompt, params)
    got: dict[str, list[int]] = {f"q{base}-{i}": [] for i in range(len(requests))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
    return list(got.values())


def _check(model_dir, algorithm: dict, **cfg) -> dict:
    """Alone (each seeded request three times in turn, after another seed's continuation of its start) and batched beside other traffic, with
    speculation, equal the same without; returns the speculative engine's stats."""
    prompts = _prompts()
    plain = make_engine(model_dir, **cfg)
    alone = [_run(plain, [(p, SEEDED)])[0] for p in prompts]
    batched = _run(plain, _traffic(prompts))
    assert batched[:3] == alone
    spec = make_engine(model_dir, **algorithm, **cfg)
    for i, p in enumerate(prompts):
        # n-gram: after the seeded request's 4th token the shared table drafts another continuation
        _run(spec, [(p + alone[i][:4], OTHER_SEED)])
        for turn in range(3):
            assert _run(spec, [(p, SEEDED)])[0] == alone[i], (i, turn)
    assert _run(spec, _traffic(prompts)) == batched
    return spec.stats()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_seeded_tokens_do_not_depend_on_the_drafts(peaked_dir, name):
    s = _check(peaked_dir, ALGORITHMS[name])
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], "no kept or no rejected draft"


def test_seeded_tokens_do_not_depend_on_the_drafts_under_deterministic_inference(peaked_dir):
    s = _check(peaked_dir, SELF_DRAFT_HALF, enable_deterministic_inference=True)
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]


def test_a_seed_repeats_and_seeds_differ(peaked_dir):
    engine = make_engine(peaked_dir, **SPEC)
    prompt = _prompts()[1]
    by_seed = [_run(engine, [(prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=s,
                                                      ignore_eos=True))])[0] for s in (7, 8, 9, 7)]
    assert by_seed[0] == by_seed[3]
    assert len({tuple(t) for t in by_seed}) == 3
