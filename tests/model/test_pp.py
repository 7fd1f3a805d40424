"""Pipeline parallelism, PP=2 over gloo in 2 processes vs PP=1 (stages: tests/model/pp_worker.py).

On a tiny Llama (2 layers, tied embeddings: the last stage keeps the embedding as its head), a tiny GLM-4.5 MoE (3
layers on 2 stages: 2 + 1; a dense first layer, shared experts, untied), a tiny glm4_moe_lite (MLA, 3 layers) and a
tiny glm_moe_dsa (DSA, 5 layers: 3 + 2, stage 1 starting on an IndexShare layer, so it receives stage 0's top-k; the
64- and 71-token prompts past index_topk 8), with prompts chunked by 32 (one asking for prompt logprobs), batches of
several sequences and a 90 % radix hit, at M = 2 (the default), 1 and 3 micro-batches:
logits within 1e-5 relative and greedy tokens equal to PP=1, and the same whatever M is; the last stage's logits
bit-identical to what rank 0 samples from; per-rank parameter and KV bytes and per-step point-to-point bytes equal
docs/parallel.md's formulas exactly (KV: latent and index keys for MLA/DSA); at M = 1 each stage's DSA top-k
bit-identical to PP=1's of its full layers; a stage that stops answering ends rank 0's receive with DistError after the
group's timeout, a killed stage ends rank 0's next step with DistError, and `load_runner` starts and stops its
follower. PP=3 on the MoE (one layer per stage, a middle stage): the same logits, tokens and byte formulas."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.layer_split import owned_layers
from radixserve.runner.tp import free_init_addr
from radixserve.weights.safetensors import read_hf_config
from tests.conftest import build_tiny_llama
from tests.model.pp_worker import MICRO, TIMEOUT_S
from tests.model.test_families import DSA_SHARED, build_family
from tests.model.test_tp import layer_bytes

REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = ("llama", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
PAGE = 16


def build(folder: pathlib.Path, case: str) -> str:
    if case == "llama":
        build_tiny_llama(folder)
    else:
        build_family(folder, case, spec=DSA_SHARED if case == "glm_moe_dsa" else None)
    return str(folder)


@dataclass(frozen=True)
class Group:
    """One PP group's run: its size, each case's config and folder, per rank its results (pp_worker.py)."""

    size: int
    configs: list[ModelConfig]
    folders: list[str]
    ranks: list[dict]


def run_group(tmp_path_factory, size: int, cases: tuple[str, ...]) -> Group:
    folders = [build(tmp_path_factory.mktemp(case), case) for case in cases]
    out = tmp_path_factory.mktemp(f"pp{size}-out")
    addr = free_init_addr()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.pp_worker", str(r), str(size), addr, str(out),
                               *folders], cwd=REPO, env=env) for r in range(size)]
    try:
        assert [p.wait(600) for p in procs] == [0] * size
    finally:
        for p in procs:
            p.kill()
    return Group(size, [ModelConfig.from_hf(read_hf_config(f)) for f in folders], folders,
                 [torch.load(out / f"rank{r}.pt") for r in range(size)])


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Group:
    return run_group(tmp_path_factory, 2, CASES)


@pytest.fixture(scope="module")
def group3(tmp_path_factory) -> Group:
    """PP=3 on the 3-layer MoE: one layer per stage, a middle stage that only receives, computes and sends."""
    return run_group(tmp_path_factory, 3, ("glm4_moe",))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max()) if b.numel() else 0.0


def check_same_output(out: dict, ref: dict) -> None:
    """Greedy tokens equal; the prompt logprobs' token ids equal and their values within 1e-4."""
    assert {k: v for k, v in out.items() if k != "prompt_logprobs"} == \
        {k: v for k, v in ref.items() if k != "prompt_logprobs"}
    assert len(ref["prompt_logprobs"]) == 36                    # 37 prompt tokens, two chunks
    for (tok, lp, top), (tok_ref, lp_ref, top_ref) in zip(out["prompt_logprobs"], ref["prompt_logprobs"]):
        assert (tok, top) == (tok_ref, top_ref) and abs(lp - lp_ref) <= 1e-4


def check_logits_and_tokens(g: Group, index: int, micro: int | None) -> None:
    """Logits within 1e-5 and the output equal to PP=1; the last stage's logits are the bits rank 0 samples."""
    rank0, last = g.ranks[0]["models"][index], g.ranks[-1]["models"][index]
    result, ref = rank0[micro], rank0["ref"]
    assert [s["query_lens"] for s in result["steps"]] == [s["query_lens"] for s in ref["steps"]]
    assert any(s["query_lens"] == [7] and s["context_lens"] == [71] for s in ref["steps"])    # the radix hit
    assert any(s["num_seqs"] >= 3 for s in ref["steps"])                                       # micro-batches
    for step, want in zip(result["steps"], ref["steps"]):
        assert step["logits"].shape == want["logits"].shape
        assert rel_err(step["logits"], want["logits"]) <= 1e-5
    check_same_output(result["tokens"], ref["tokens"])
    for a, b in zip(result["steps"], last[micro]["steps"]):
        assert torch.equal(a["logits"], b["logits"])


def check_micro_batch_independence(g: Group, index: int) -> None:
    rank0 = g.ranks[0]["models"][index]
    base = rank0[MICRO[0]]
    for micro in MICRO[1:]:
        check_same_output(rank0[micro]["tokens"], base["tokens"])
        for a, b in zip(rank0[micro]["steps"], base["steps"]):
            assert rel_err(a["logits"], b["logits"]) <= 1e-5


def stage_param_bytes(c: ModelConfig, stage: int, size: int) -> int:
    """docs/parallel.md: the stage's layers, plus the embedding (stage 0) and the final norm + LM head (last stage;
    a tied head is the embedding, kept there as its storage)."""
    h, v = c.hidden_size, c.vocab_size
    layers = sum(layer_bytes(c, 1, i) for i in owned_layers(c.num_layers, size, stage))
    return layers + 4 * ((v * h if stage == 0 else 0) + (v * h + h if stage == size - 1 else 0))


def stage_token_bytes(c: ModelConfig, layers: range) -> int:
    """docs/parallel.md: a stage's fp32 KV bytes per token slot: per layer K and V (2·KV·D·4) or MLA's latent
    ((r + d_rope)·4), plus DSA's index key (Di·4) per full indexer layer among `layers`."""
    if c.mla is None:
        return len(layers) * 2 * c.num_kv_heads * c.head_dim * 4
    index = c.dsa.index_head_dim * sum(1 for i in layers if i in c.dsa.full_layers) if c.dsa else 0
    return 4 * (len(layers) * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) + index)


def check_parameter_and_kv_bytes(g: Group, index: int) -> None:
    c, size = g.configs[index], g.size
    ref = g.ranks[0]["models"][index]["ref"]
    tied_twice = 4 * c.vocab_size * c.hidden_size * c.tie_word_embeddings    # a tied embedding is held twice
    assert sum(stage_param_bytes(c, s, size) for s in range(size)) == ref["param_bytes"] + tied_twice
    for stage in range(size):
        result = g.ranks[stage]["models"][index]
        layers = owned_layers(c.num_layers, size, stage)
        for micro in MICRO:
            assert result[micro]["param_bytes"] == stage_param_bytes(c, stage, size)
            assert result[micro]["kv_layers"] == len(layers)
            assert result[micro]["kv_bytes"] == result[micro]["num_pages"] * PAGE * stage_token_bytes(c, layers)
        # without --max-total-tokens every stage sizes its pages for the stage of most KV bytes per token
        most = max(stage_token_bytes(c, owned_layers(c.num_layers, size, s)) for s in range(size))
        assert result["sized_pages"] == int(0.001 * 2**30) // (PAGE * most)


def check_point_to_point_bytes(g: Group, index: int, micro: int | None) -> None:
    """Per step, M' = min(M, B) micro-batches: stage s < N-1 sends T * h * 4 (the residual) in M' sends and stage
    s > 0 receives it in M' receives; the last stage sends R * V * 4 (the logit rows) to rank 0, one message per
    micro-batch with logit rows. DSA, where stage s + 1 starts on an IndexShare layer: stage s also sends it, per
    micro-batch with a sequence past index_topk K, those sequences' query rows x K int64 (the top-k)."""
    c, size = g.configs[index], g.size
    h, v = c.hidden_size, c.vocab_size
    m = micro or size
    k = c.dsa.index_topk if c.dsa else 0
    shared = [c.dsa is not None and owned_layers(c.num_layers, size, s).start not in c.dsa.full_layers
              for s in range(1, size)]
    for stage in range(size):
        for step in g.ranks[stage]["models"][index][micro]["steps"]:
            parts = min(m, step["num_seqs"])
            base, rem = divmod(step["num_seqs"], parts)
            sizes = [base + (i < rem) for i in range(parts)]
            firsts = [sum(sizes[:i]) for i in range(parts)]
            with_rows = sum(1 for f, n in zip(firsts, sizes) if sum(step["seq_logit_rows"][f:f + n]))
            act, logits = step["num_tokens"] * h * 4, step["logit_rows"] * v * 4
            rows = [sum(q for q, ctx in zip(step["query_lens"][f:f + n], step["context_lens"][f:f + n]) if ctx > k)
                    for f, n in zip(firsts, sizes)] if k else []
            picks = [r * k * 8 for r in rows if r]
            out = picks if stage < size - 1 and shared[stage] else []
            into = picks if stage > 0 and shared[stage - 1] else []
            sent = (act if stage < size - 1 else logits) + sum(out)
            got = (act if stage > 0 else logits) + sum(into)
            sends = (parts if stage < size - 1 else with_rows) + len(out)
            recvs = (parts if stage > 0 else with_rows) + len(into)
            assert step["bytes"] == {k: n for k, n in (("send", sent), ("recv", got)) if n}
            assert step["calls"] == {k: n for k, n in (("send", sends), ("recv", recvs)) if n}


@pytest.mark.parametrize("micro", MICRO)
@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_pp2_logits_and_greedy_tokens_equal_pp1(group, index, micro):
    check_logits_and_tokens(group, index, micro)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_the_output_does_not_depend_on_the_micro_batch_count(group, index):
    check_micro_batch_independence(group, index)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_parameter_and_kv_bytes_equal_the_formulas(group, index):
    check_parameter_and_kv_bytes(group, index)
    assert [len(owned_layers(3, 2, s)) for s in range(2)] == [2, 1]


@pytest.mark.parametrize("micro", MICRO)
@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_point_to_point_bytes_equal_the_formulas(group, index, micro):
    check_point_to_point_bytes(group, index, micro)


def same_selection(a: list | None, b: list | None) -> bool:
    return (a is None) == (b is None) and len(a or ()) == len(b or ()) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a or (), b or ()))


def test_each_dsa_stage_selects_pp1s_top_k(group):
    """At M = 1 (one micro-batch: PP=1's arithmetic), stage s's indexer calls are PP=1's calls of its full layers,
    bit-identical; both stages really select (index_topk of a longer context)."""
    index = CASES.index("glm_moe_dsa")
    c = group.configs[index]
    full = c.dsa.full_layers
    ref = group.ranks[0]["models"][index]["ref"]["topk"]
    steps = len(ref) // len(full)
    assert steps and len(ref) == steps * len(full)
    for stage in range(group.size):
        mine = [j for j, i in enumerate(full) if i in owned_layers(c.num_layers, group.size, stage)]
        got = group.ranks[stage]["models"][index][1]["topk"]
        want = [ref[step * len(full) + j] for step in range(steps) for j in mine]
        assert len(got) == len(want) and all(same_selection(a, b) for a, b in zip(got, want))
        assert any(x is not None and x.shape[1] == c.dsa.index_topk for out in got for x in out or ())


def test_pp3_with_a_middle_stage_equals_pp1_with_exact_bytes(group3):
    for micro in MICRO:
        check_logits_and_tokens(group3, 0, micro)
        check_point_to_point_bytes(group3, 0, micro)
    check_micro_batch_independence(group3, 0)
    check_parameter_and_kv_bytes(group3, 0)


def test_a_hung_stage_ends_rank_0s_receive_with_an_error(group):
    hung = group.ranks[0]["hung"]
    assert "recv failed on rank 0" in hung["error"]
    assert hung["waited_s"] >= TIMEOUT_S * 0.9     # it waited out the group's timeout, then failed (no hang)


def test_serving_path_starts_and_stops_its_follower(group):
    """load_runner (what `serve --pp-size 2` calls) on this process as stage 0: PP=1's greedy tokens, and close()
    ends the follower process with code 0."""
    from radixserve.runner.tp import load_runner
    from tests.model.tp_worker import generate

    config = EngineConfig(model_path=group.folders[1], pp_size=2, max_total_tokens=4096, quantization="none",
                          chunked_prefill_size=32, num_threads=1)
    runner = load_runner(config)
    try:
        assert runner.info()["pp_stage_layers"] == [0, 2]
        tokens = generate(runner)
    finally:
        runner.close()
    assert [p.returncode for p in runner.followers.processes] == [0]
    assert tokens == generate(load_runner(dataclasses.replace(config, pp_size=1)))


def test_a_killed_stage_ends_rank_0s_step_with_an_error(group):
    """Stage 1 dies between steps; rank 0's next step raises DistError (no hang), and close() still returns."""
    from radixserve.dist.comm import DistError
    from radixserve.runner.tp import load_runner
    from tests.model.tp_worker import generate

    runner = load_runner(EngineConfig(model_path=group.folders[0], pp_size=2, max_total_tokens=4096,
                                      quantization="none", num_threads=1, dist_timeout=30))
    try:
        follower = runner.followers.processes[0]
        follower.kill()
        follower.wait(60)
        with pytest.raises(DistError, match="rank 0"):
            generate(runner)
    finally:
        runner.close()
