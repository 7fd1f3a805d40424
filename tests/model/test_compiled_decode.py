"""--compile on: the compiled decode (runner/compiled_decode.py) gives eager's greedy tokens under radix hits, chunking
and preemption, on a Llama and a MoE family, with no recompilation after warm-up (C62, C63). Slow: Inductor compiles
C++ (one shared runner per family; later starts of the same key load the disk cache)."""
from __future__ import annotations

import pytest

from radixserve.sampling_params import SamplingParams
from tests.conftest import build_tiny_llama
from tests.model.gguf_convert import write_gguf
from tests.model.parity import TIE_GAP
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_parity import make_engine, prompt_set
from tests.model.test_quantized import TYPES

pytestmark = pytest.mark.slow
# Small chunks: prompts are chunked. A KV of 256 tokens does not hold 6 requests at once, so some are preempted and
# recomputed, and the second round hits the radix cache. Later engines of one key load the first's graphs from disk.
CFG = {"chunked_prefill_size": 32, "torch_compile_max_bs": 4}
KV_TOKENS = 256
NUM_NEW = 24


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def glm4_moe_dir(tmp_path_factory):
    """Two layers: the dense first one and one MoE layer (Inductor's C++ grows with the layers)."""
    config_cls, model_cls, extra = FAMILIES["glm4_moe"]
    return build_family(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe",
                        spec=(config_cls, model_cls, {**extra, "num_hidden_layers": 2}))


def generate(engine, prompts: list[list[int]]) -> list[list[tuple[int, list]]]:
    """Greedy NUM_NEW tokens per prompt, all submitted at once: [(token, top-2 (id, logprob))] per prompt."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True, logprobs=2)
    got: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{len(engine.counters)}-{engine.counters['num_finished_requests']}-{i}",
                           prompt, params)
    order = list(engine.scheduler.waiting)
    ids = [r.request_id for r in order]
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend((lp.token_id, lp.top) for lp in out.new_logprobs)
        engine.check_invariants()
    return [got[r] for r in ids]


def assert_same_greedy(compiled: list, eager: list, label: str) -> None:
    """Equal tokens, or a first difference where eager's top-2 logprobs tie (gap < TIE_GAP), the parity tests' rule."""
    ours, ref = [t for t, _ in compiled], [t for t, _ in eager]
    if ours == ref:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
    top = eager[i][1]
    gap = top[0][1] - top[1][1]
    print(f"{label}: first difference at {i}: compiled {ours[i]}, eager {ref[i]}, gap {gap:.3g}")
    assert gap < TIE_GAP, f"{label}: compiled differs from eager at {i} (top-2 gap {gap:.3g} is no tie)"


@pytest.mark.parametrize("family", ["llama", "glm4_moe"])
def test_compiled_decode_matches_eager(request, compile_cache, family):
    folder = request.getfixturevalue("gqa_dir" if family == "llama" else "glm4_moe_dir")
    vocab = 384 if family == "llama" else 256
    prompts = prompt_set(vocab, 5, [3, 40, 17, 70, 9, 33])
    cfg = {**CFG, "max_total_tokens": KV_TOKENS}
    eager = make_engine(folder, **cfg)
    compiled = make_engine(folder, compile="on", **cfg)
    graphs = compiled.runner.decode_graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4]
    warm = graphs.graphs
    cached = []
    for round_ in range(2):
        want, got = generate(eager, prompts), generate(compiled, prompts)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_greedy(g, w, f"{family} round {round_} prompt {i}")
        cached.append(compiled.counters["num_cached_tokens"])
    assert compiled.scheduler.num_preemptions > 0 and cached[1] > cached[0], cached   # round 2 hits the radix cache
    info = compiled.runner.info()["compile"]
    assert info["steps"] > 0, info                     # the compiled graphs ran
    assert info["direct"] == graphs.buckets, info      # called directly, past Dynamo
    assert info["recompiles"] == 0 and graphs.graphs == warm, info   # C63: nothing compiled after warm-up
    graphs._direct.clear()                              # the Dynamo call (a bucket whose check failed) gives the same
    for i, (g, w) in enumerate(zip(generate(compiled, prompts), generate(eager, prompts))):
        assert_same_greedy(g, w, f"{family} through Dynamo, prompt {i}")
    assert graphs.recompiles == 0 and graphs.graphs == warm, graphs.info()


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q4")
    write_gguf(build_tiny_llama(folder / "hf", vocab_size=384, num_attention_heads=4, num_key_value_heads=2),
               folder / "tiny-q4.gguf", TYPES)
    return folder / "tiny-q4.gguf"


@pytest.mark.parametrize("quantization", ["int4-int8", "int4-fp32"])
def test_compiled_own_int4_kernel_decode_matches_eager(q4_gguf, compile_cache, quantization):
    """--quantization int4-int8 / int4-fp32: its kernel (a custom op with a fake kernel for Inductor,
    csrc/ops.py) runs inside the compiled graphs (no graph break), and greedy output is eager's, under
    preemption and radix hits. Buckets 1 and 2 (one row and several): padding is the family test's."""
    from torch._dynamo.utils import counters

    from radixserve.csrc import LIBRARY
    from radixserve.layers import int4_fp32, int4_int8
    chosen_isa = (int4_int8 if quantization == "int4-int8" else int4_fp32).chosen_isa
    assert chosen_isa() is not None or not LIBRARY.exists()     # built: the kernel runs, not reference_mm
    counters.clear()
    prompts = prompt_set(384, 5, [3, 40, 17, 70, 9, 33])
    cfg = {**CFG, "torch_compile_max_bs": 2, "max_total_tokens": KV_TOKENS, "quantization": quantization}
    eager, compiled = make_engine(q4_gguf, **cfg), make_engine(q4_gguf, compile="on", **cfg)
    assert compiled.runner.decode_graphs.buckets == [1, 2]
    mlp = compiled.runner.model.model.layers[0].mlp
    assert all(layer.quantized for layer in mlp.children())
    cached = []
    for round_ in range(2):
        for i, (g, w) in enumerate(zip(generate(compiled, prompts), generate(eager, prompts))):
            assert_same_greedy(g, w, f"{quantization} round {round_} prompt {i} ({chosen_isa()})")
        cached.append(compiled.counters["num_cached_tokens"])
    assert compiled.scheduler.num_preemptions > 0 and cached[1] > cached[0], cached
    info = compiled.runner.info()["compile"]
    assert info["steps"] > 0 and info["recompiles"] == 0 and info["direct"] == [1, 2], info
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_decode_with_ngram_speculation(gqa_dir, compile_cache):
    """A step verifying drafts whose rows fit a bucket (every row a logit row) runs the bucket's graph, larger ones
    eagerly beside it (here most decode steps carry drafts: the random model repeats itself); greedy output is
    still eager's."""
    prompts = prompt_set(384, 6, [12, 30, 5, 50])
    cfg = {**CFG, "max_total_tokens": 2048, "speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}
    eager, compiled = make_engine(gqa_dir, **cfg), make_engine(gqa_dir, compile="on", **cfg)
    for i, (g, w) in enumerate(zip(generate(compiled, prompts), generate(eager, prompts))):
        assert_same_greedy(g, w, f"ngram prompt {i}")
    info = compiled.runner.info()["compile"]
    assert compiled.counters["spec_num_verify_steps"] > info["verify_steps"] > 0, (dict(compiled.counters), info)
    assert info["recompiles"] == 0, info


def test_compiled_decode_with_eagle_returns_the_hidden_state(tmp_path, compile_cache):
    """EAGLE / NextN: the graphs also return the final hidden state, which the MTP layer drafts from, for decode steps
    (a draft under --speculative-draft-min-prob is not proposed) and verify steps that fit a bucket; greedy output
    is eager's."""
    from tests.model.mtp_checkpoint import build_glm_mtp
    from tests.model.test_mtp import EAGLE
    build_glm_mtp(tmp_path)
    prompts = prompt_set(256, 6, [12, 30, 5, 50])
    cfg = {**CFG, "max_total_tokens": 2048}
    spec = {**EAGLE, "speculative_draft_min_prob": 0.006}
    eager, compiled = make_engine(tmp_path, **cfg, **spec), make_engine(tmp_path, compile="on", **cfg, **spec)
    assert compiled.runner.decode_graphs.hidden
    for i, (g, w) in enumerate(zip(generate(compiled, prompts), generate(eager, prompts))):
        assert_same_greedy(g, w, f"EAGLE prompt {i}")   # eager EAGLE = no speculation: tests/model/test_mtp.py
    alone = prompt_set(256, 7, [20])   # one sequence: its verify steps (4 rows) fit bucket 4
    assert_same_greedy(generate(compiled, alone)[0], generate(eager, alone)[0], "EAGLE, one sequence")
    info = compiled.runner.info()["compile"]
    assert compiled.counters["spec_num_verify_steps"] > 0, dict(compiled.counters)
    assert info["steps"] > info["verify_steps"] > 0, info   # plain steps and verify steps of one sequence
    assert info["recompiles"] == 0 and info["direct"] == compiled.runner.decode_graphs.buckets, info


def test_steady_state_soak_compiles_nothing(gqa_dir, compile_cache):
    """C63: after warm-up, 60 requests of varied lengths, arrival waves and sampling (greedy, seeded, penalties,
    logprobs) compile no graph: every decode step of <= 4 sequences runs a start-up graph, larger ones run eagerly."""
    import random
    engine = make_engine(gqa_dir, compile="on", **CFG, max_total_tokens=2048)
    graphs = engine.runner.decode_graphs
    warm = graphs.graphs
    rng = random.Random(7)
    for i in range(60):
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.7]), seed=rng.randint(0, 9),
                                top_p=rng.choice([1.0, 0.9]), frequency_penalty=rng.choice([0.0, 0.5]),
                                logprobs=rng.choice([None, 3]))
        engine.add_request(f"s{i}", [rng.randrange(3, 384) for _ in range(rng.randint(1, 60))], params)
        while engine.has_unfinished() and rng.random() < 0.7:
            engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert graphs.steps > 20 and graphs.recompiles == 0 and graphs.graphs == warm, graphs.info()


FALLBACK = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
from tests.model.test_parity import make_engine, prompt_set
engine = make_engine(sys.argv[1], compile="on")
assert engine.runner.decode_graphs is None
print("tokens", len(__import__("tests.model.parity", fromlist=["x"]).engine_generate(
    engine, prompt_set(384, 1, [5, 9]), 4)[0][1]))
"""


def test_no_compiler_falls_back_to_eager_with_one_line(gqa_dir, tmp_path):
    """--compile on with g++ hidden (PATH without it, no CXX) and an empty cache: one warning (after the progress
    line that starts compiling), then eager decode."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PATH": str(tmp_path), "RADIXSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.getcwd()}
    env.pop("CXX", None)
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(gqa_dir)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [ln for ln in done.stdout.splitlines() if ln.startswith(("WARNING", "ERROR"))]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING compiled decode failed, decoding eagerly: "), \
        done.stdout
    assert "tokens 4" in done.stdout
