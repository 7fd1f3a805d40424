"""--pp-size 2 --tp-size 2 over gloo in 4 processes vs one process (ranks: tests/model/pp_tp_worker.py).

On a tiny Llama (vocabulary 257, not divisible by 2; tied embeddings; one KV head, replicated; random biases), a tiny
GLM-4.5 MoE (3 layers on 2 stages: 2 + 1; --ep-size 2: whole experts per TP rank) and test_pp.py's 5-layer glm_moe_dsa
(stage 1 starts on a shared layer: it receives the top-k), pp_worker's prompts (chunked by 32, prompt logprobs, a radix
hit) at M = 2 micro-batches: logits within 1e-5 relative and greedy tokens equal to PP=1 TP=1; the last stage's
ranks' logits bit-identical to rank 0's; per-rank parameter and KV bytes, the sized page count and per-step
point-to-point (world group) and collective (TP group) bytes and calls equal docs/parallel.md's formulas exactly; a rank that exits inside a forward ends the survivors' step with DistError."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from radixserve.models.model_config import ModelConfig
from radixserve.runner.layer_split import owned_layers
from radixserve.runner.tp import free_init_addr
from radixserve.weights.safetensors import read_hf_config
from tests.conftest import build_tiny_llama
from tests.model.pp_tp_worker import PP, TIMEOUT_S, TP
from tests.model.test_families import DSA_SHARED, build_family
from tests.model.test_pp import REPO, check_same_output, rel_err
from tests.model.test_tp import layer_bytes, randomize_biases

CASES = {"llama257": 1, "glm4_moe": 2, "glm_moe_dsa": 1}      # case -> --ep-size
PAGE = 16
WORLD = PP * TP


def build(folder, case: str) -> str:
    if case == "llama257":
        build_tiny_llama(folder, vocab_size=257, num_key_value_heads=1, attention_bias=True, mlp_bias=True)
        randomize_biases(folder)
    else:
        build_family(folder, case, spec=DSA_SHARED if case == "glm_moe_dsa" else None)
    return str(folder)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(each case's ModelConfig, per rank its results, per surviving rank its dead-rank record)."""
    folders = [build(tmp_path_factory.mktemp(case), case) for case in CASES]
    out = tmp_path_factory.mktemp("pp-tp-out")
    args = [a for folder, ep in zip(folders, CASES.values()) for a in (folder, str(ep))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    addr = free_init_addr()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.pp_tp_worker", str(r), addr, str(out), *args],
                              cwd=REPO, env=env) for r in range(WORLD)]
    try:
        assert [p.wait(600) for p in procs] == [0] * WORLD
    finally:
        for p in procs:
            p.kill()
    configs = [ModelConfig.from_hf(read_hf_config(f)) for f in folders]
    return (configs, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)],
            {r: torch.load(out / f"dead{r}.pt") for r in range(WORLD - 1)})


def micro_batches(step: dict, k: int, m: int = PP) -> tuple[int, int, list[int]]:
    """Of a recorded step cut into min(M, B) runs of consecutive sequences: (micro-batches, those with logit rows,
    per micro-batch with a sequence past index_topk k > 0 the top-k's bytes: its query rows x k x 8)."""
    parts = min(m, step["num_seqs"])
    base, rem = divmod(step["num_seqs"], parts)
    sizes = [base + (i < rem) for i in range(parts)]
    firsts = [sum(sizes[:i]) for i in range(parts)]
    rows = [sum(q for q, ctx in zip(step["query_lens"][f:f + n], step["context_lens"][f:f + n]) if ctx > k)
            for f, n in zip(firsts, sizes)] if k else []
    return (parts, sum(1 for f, n in zip(firsts, sizes) if sum(step["seq_logit_rows"][f:f + n])),
            [r * k * 8 for r in rows if r])


@pytest.mark.parametrize("index", range(len(CASES)), ids=list(CASES))
def test_logits_and_greedy_tokens_equal_one_process(group, index):
    rank0 = group[1][0][index]
    ref = rank0["ref"]
    assert [s["query_lens"] for s in rank0["steps"]] == [s["query_lens"] for s in ref["steps"]]
    assert any(s["num_seqs"] >= 3 for s in ref["steps"]) and any(s["query_lens"] == [7] for s in ref["steps"])
    for step, want in zip(rank0["steps"], ref["steps"]):
        assert step["logits"].shape == want["logits"].shape
        assert rel_err(step["logits"], want["logits"]) <= 1e-5
    check_same_output(rank0["tokens"], ref["tokens"])


@pytest.mark.parametrize("index", range(len(CASES)), ids=list(CASES))
def test_last_stage_ranks_hold_rank_0s_logits_bit_for_bit(group, index):
    ranks = [r[index] for r in group[1]]
    assert [r["stage"] for r in ranks] == [(s, t) for s in range(PP) for t in range(TP)]
    for rank in ranks[1:]:
        assert len(rank["steps"]) == len(ranks[0]["steps"])
        for mine, want in zip(rank["steps"], ranks[0]["steps"]):
            if rank["stage"][0] == PP - 1:
                assert torch.equal(mine["logits"], want["logits"])
            else:
                assert mine["logits"].shape[0] == 0


def stage_param_bytes(c: ModelConfig, stage: int, ep: int) -> int:
    """docs/parallel.md: the stage's layers at TP T, plus V_r * h (V_r = ceil(V / T)) for the embedding on stage 0 and
    V_r * h + h for the LM head and final norm on the last stage."""
    vocab = -(-c.vocab_size // TP) * c.hidden_size
    layers = sum(layer_bytes(c, TP, i, ep) for i in owned_layers(c.num_layers, PP, stage))
    return layers + 4 * ((vocab if stage == 0 else 0) + (vocab + c.hidden_size if stage == PP - 1 else 0))


def token_kv_bytes(c: ModelConfig, layers: range) -> int:
    """docs/parallel.md: one token's KV bytes on a rank holding decoder `layers`: K and V of kv_r = max(1, KV / T) heads
    per layer, or MLA's latent (r + d_rope) per layer and DSA's index key (Di) per full indexer layer (fp32)."""
    if c.mla is None:
        return len(layers) * 2 * max(1, c.num_kv_heads // TP) * c.head_dim * 4
    full = sum(1 for i in layers if i in c.dsa.full_layers) if c.dsa else 0
    return 4 * (len(layers) * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) + full * c.dsa.index_head_dim)


@pytest.mark.parametrize("index", range(len(CASES)), ids=list(CASES))
def test_parameter_and_kv_bytes_equal_the_formulas(group, index):
    """Without --max-total-tokens every rank sizes its pages for the stage of most KV bytes per token."""
    c, ep = group[0][index], list(CASES.values())[index]
    stages = [owned_layers(c.num_layers, PP, s) for s in range(PP)]
    sized = int(0.001 * 2**30) // (PAGE * max(token_kv_bytes(c, r) for r in stages))
    for rank, result in enumerate(r[index] for r in group[1]):
        layers = stages[rank // TP]
        assert result["param_bytes"] == stage_param_bytes(c, rank // TP, ep)
        assert (result["kv_layers"], result["num_pages"]) == (len(layers), 4096 // PAGE)
        assert result["kv_bytes"] == result["num_pages"] * PAGE * token_kv_bytes(c, layers)
        assert result["sized_pages"] == sized


@pytest.mark.parametrize("index", range(len(CASES)), ids=list(CASES))
def test_point_to_point_and_collective_bytes_equal_the_formulas(group, index):
    """Per step, M' micro-batches (M'_R of them with logit rows), on a rank of stage s holding n_s layers:
    world group: stage s < P-1 sends T*(h/T)*4 (its columns of the residual) in M' sends, stage s > 0 receives as much;
    the last stage's tp_rank 0 sends R*V*4 in M'_R sends and rank 0 receives them; DSA, stage 1 starting on a shared
    layer: each tp_rank of stage 0 also sends its peer the top-k of each micro-batch with a sequence past index_topk.
    TP group: (1[s = 0] + 2 n_s) * T*h*4 all-reduced in M' times as many calls; all-gathered: T*(h/T)*4 on s > 0
    (M' calls) and R*ceil(V/T)*4 on the last stage (M'_R calls)."""
    c = group[0][index]
    h, v, k = c.hidden_size, c.vocab_size, c.dsa.index_topk if c.dsa else 0
    shared = c.dsa is not None and owned_layers(c.num_layers, PP, 1).start not in c.dsa.full_layers
    assert shared == (c.dsa is not None)
    assert all(not c.dsa or any(micro_batches(step, k)[2] for step in r[index]["steps"]) for r in group[1][:TP])
    for rank, result in enumerate(r[index] for r in group[1]):
        stage, tp_rank = divmod(rank, TP)
        n_s = len(owned_layers(c.num_layers, PP, stage))
        for step, tp_step in zip(result["steps"], result["tp_steps"], strict=True):
            parts, with_rows, picks = micro_batches(step, k)
            t, r = step["num_tokens"], step["logit_rows"]
            p2p = {"send": (0, 0), "recv": (0, 0)}
            if stage < PP - 1:
                p2p["send"] = (parts + len(picks), t * h // TP * 4 + sum(picks))
            if stage > 0:
                p2p["recv"] = (parts + len(picks), t * h // TP * 4 + sum(picks))
            if stage == PP - 1 and tp_rank == 0:
                p2p["send"] = (with_rows, r * v * 4)
            if rank == 0:
                p2p["recv"] = (with_rows, r * v * 4)
            assert step["calls"] == {op: n for op, (n, b) in p2p.items() if b}
            assert step["bytes"] == {op: b for op, (n, b) in p2p.items() if b}
            reduces = (stage == 0) + 2 * n_s
            gathers = {"calls": 0, "bytes": 0}
            if stage > 0:
                gathers = {"calls": parts, "bytes": t * h // TP * 4}
            if stage == PP - 1:
                gathers = {"calls": gathers["calls"] + with_rows,
                           "bytes": gathers["bytes"] + r * -(-v // TP) * 4}
            assert tp_step["calls"] == {"all_reduce": parts * reduces,
                                        **({"all_gather": gathers["calls"]} if gathers["calls"] else {})}
            assert tp_step["bytes"] == {"all_reduce": reduces * t * h * 4,
                                        **({"all_gather": gathers["bytes"]} if gathers["bytes"] else {})}


def test_a_rank_that_exits_ends_the_group_with_an_error(group):
    """Rank 3 (stage 1, tp_rank 1) exits inside a step's forward: rank 0's step raises DistError within the group's
    timeout (in the forward, not at the step broadcast), and so does every other survivor's."""
    dead = group[2]
    assert all(dead[r]["error"] for r in dead), dead
    assert "failed on rank 0" in dead[0]["error"] and not dead[0]["error"].startswith("broadcast_object")
    assert dead[0]["waited_s"] < 2 * TIMEOUT_S
