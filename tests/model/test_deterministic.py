"""--enable-deterministic-inference: a request's tokens and logprobs are bit-identical whatever
else is batched, however its prompt is chunked, and whether its prefix came from the cache
(issue 11, finding 4). Also still transformers-exact (the parity harness) and refused where it
cannot hold."""
from __future__ import annotations

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from tests.model.test_families import build_family
from tests.model.test_parity import make_engine, prompt_set
from tests.model.test_runner import Harness, Seq, mixed_batch_scenario

DET = {"enable_deterministic_inference": True}


def _record(runner: ModelRunner, steps: list[list[tuple[Seq, int | None]]], watch: Seq) -> list[tuple]:
    """Run steps of (seq, chunk length or None for the rest); return `watch`'s sampled tokens as
    (id, logprob, top) with exact floats."""
    got = []
    for step in steps:
        items = [(seq, seq.chunk(n)) for seq, n in step]
        out = runner.run([s for _, s in items])
        for (seq, sched), res in zip(items, out):
            seq.computed = sched.start_pos + len(sched.input_ids)
            if res.token_ids:
                seq.output.append(res.token_ids[-1])
                if seq is watch:
                    got.append((res.token_ids[-1], res.logprobs[-1].logprob, tuple(res.logprobs[-1].top)))
    return got


@pytest.fixture(scope="module")
def glm4_moe_dir(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe")


@pytest.mark.parametrize("model", ["llama", "glm4_moe"])
def test_tokens_and_logprobs_do_not_depend_on_batch_chunking_or_cache(request, model):
    """glm4_moe adds routed experts (how many tokens an expert gets depends on the batch),
    q/k norm and partial RoPE."""
    folder = request.getfixturevalue("gqa_dir" if model == "llama" else "glm4_moe_dir")
    h = Harness(folder, 16, seed=1, **DET)
    prompt = [h.rng.randrange(3, h.vocab) for _ in range(150)]

    alone = h.new_seq("alone", 0)
    alone.prompt = list(prompt)
    ref = _record(h.runner, [[(alone, None)]] + [[(alone, None)]] * 5, alone)

    # Beside other prefills and decodes, the prompt cut at 70 (inside a key block).
    mixed = h.new_seq("mixed", 0)
    mixed.prompt = list(prompt)
    others = [h.new_seq(f"o{i}", 20 + 9 * i) for i in range(3)]
    steps = [[(o, None) for o in others],
             [(others[0], None), (mixed, 70), (others[1], None)],
             [(mixed, None)] + [(o, None) for o in others]]
    steps += [[(others[0], None), (mixed, None), (others[2], None)]] * 5
    assert _record(h.runner, steps, mixed) == ref

    # A cached prefix of 64 tokens whose KV another request computed in one 100-token chunk,
    # then the rest in 1-token and 40-token chunks.
    donor = h.new_seq("donor", 0)
    donor.prompt = prompt[:64] + [h.rng.randrange(3, h.vocab) for _ in range(36)]
    _record(h.runner, [[(donor, None)]], donor)
    hit = h.new_seq("hit", 0)
    hit.prompt = list(prompt)
    hit.pages = donor.pages[:4] + hit.pages[4:]
    hit.computed = 64
    steps = [[(hit, 1)], [(hit, 40), (donor, None)], [(hit, None)]] + [[(hit, None), (donor, None)]] * 5
    assert _record(h.runner, steps, hit) == ref


def _generate(engine, prompts: list[list[int]], at_once: bool) -> list[list[tuple[int, float]]]:
    """Greedy 48 tokens per prompt with their logprobs (exact floats)."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=0)
    got: dict[str, list[tuple[int, float]]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and (at_once or not engine.has_unfinished()):
            batch, pending = (pending, []) if at_once else (pending[:1], pending[1:])
            for i, prompt in batch:
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend((t.token_id, t.logprob) for t in out.new_logprobs or [])
        engine.check_invariants()
    return [got[str(i)] for i in range(len(prompts))]


def test_tokens_and_logprobs_equal_one_at_a_time_and_under_preemption(gqa_dir):
    prompts = prompt_set(384, 7, [5, 17, 33, 64, 90, 129, 150, 200])
    alone = _generate(make_engine(gqa_dir, **DET), prompts, at_once=False)
    tight = make_engine(gqa_dir, max_total_tokens=640, chunked_prefill_size=32, **DET)
    together = _generate(tight, prompts, at_once=True)
    assert tight.stats()["num_preemptions"] > 0
    assert all(len(x) == 48 for x in alone) and together == alone


@pytest.mark.parametrize("decodes_first", [True, False])
def test_deterministic_mode_matches_transformers(mha_dir, decodes_first):
    mixed_batch_scenario(Harness(mha_dir, 16, seed=5, **DET), decodes_first, mixed_steps=3)


def test_deterministic_mode_is_reported_and_uses_batch_invariant_layers(gqa_dir):
    runner = ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), max_total_tokens=512, **DET))
    assert runner.info()["deterministic_inference"] is True
    assert runner.info()["attention_backend"] == "batch_invariant"


@pytest.mark.parametrize("config, message", [
    ({"attention_backend": "torch"}, "leave --attention-backend at auto"),
    ({"device": "cuda"}, "cuda"),
])
def test_deterministic_mode_is_refused_where_it_cannot_hold(gqa_dir, config, message):
    with pytest.raises(ValueError, match=message):
        ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), max_total_tokens=512, **DET, **config))


@pytest.mark.parametrize("quantization", ["none", "int4-int8", "int4-fp32"])
def test_seeded_sampling_same_alone_and_beside_other_streams(default_gguf, quantization):
    """The issue's recipe on the default model: a seeded T=1.0 request alone, then beside three
    other streams with a small token budget (different chunking, its prefix now cached); int4-int8 / int4-fp32: on
    its kernel."""
    llm = LLM(max_total_tokens=4096, chunked_prefill_size=48, quantization=quantization, **DET)
    if quantization != "none":
        assert all(layer.quantized for layer in llm.engine.runner.model.model.layers[0].mlp.children())
    prompt = ("You are a careful storyteller. Keep sentences short and concrete. "
              "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    others = ["Explain how a refrigerator works, step by step, for a child. " * 2,
              "List five prime numbers and say why each is prime.",
              "Translate 'good morning, how are you today?' into French and Spanish."]
    together = llm.generate(others[:2] + [prompt] + others[2:],
                            [SamplingParams(temperature=0.8, seed=i, max_tokens=30) for i in range(2)]
                            + [params] + [SamplingParams(temperature=0, max_tokens=40)], use_tqdm=False)
    beside = together[2].outputs[0]
    assert together[2].num_cached_tokens > 0
    assert beside.token_ids == alone.token_ids
    assert [lp.logprob for lp in beside.logprobs] == [lp.logprob for lp in alone.logprobs]
