"""Context-parallel prefill and LayerSplit, CP=2 and CP=4 over gloo vs CP=1 (ranks: tests/model/cp_worker.py).

CP=2 on a tiny Llama of 3 layers (LayerSplit owners uneven: rank 0 layers 0-1, rank 1 layer 2; untied head), a tiny
Qwen3 of 2 layers, and tiny glm4_moe_lite (MLA: the latent head gathered and broadcast, K only) and glm_moe_dsa (MLA +
the DSA indexer, index_topk 8: index keys gathered, and broadcast before the KV) of 3 layers; prompts of 1, 2, 3, 37
and 38 tokens chunked by 32, then a 64-token prompt and the same 64 tokens + 7 (a 90 % radix hit): logits within 1e-5
relative and greedy tokens equal to CP=1 (C57), both ranks bit-identical, per-rank KV bytes and per-step collective
bytes equal docs/parallel.md's formulas exactly, the LayerSplit order per layer (DSA: index keys broadcast -> indexer
-> wait(KV) -> attention), and a dropped KV wait gives wrong logits where the normal path is exact. CP=4 on the Llama
(4 processes on 2 cores) and glm_moe_dsa (the indexer's rows at stride 4, sequences with no row on some ranks): rank 3
owns no layer, and the same logits, tokens and byte formulas hold."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from radixserve.models.model_config import ModelConfig
from radixserve.runner.layer_split import owned_layers
from radixserve.runner.tp import free_init_addr
from radixserve.weights.safetensors import read_hf_config
from tests.conftest import build_tiny_llama
from tests.model.test_families import build_family

REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = ("llama3", "qwen3", "glm4_moe_lite", "glm_moe_dsa")
CASES4 = ("llama3", "glm_moe_dsa")
MODES = ("plain", "layer_split")
PAGE = 16


def build(folder: pathlib.Path, case: str) -> str:
    if case == "llama3":
        build_tiny_llama(folder, num_hidden_layers=3, tie_word_embeddings=False)
    else:
        build_family(folder, case)
    return str(folder)


def run_group(tmp_path_factory, size: int, cases: tuple[str, ...]) -> tuple[list[ModelConfig], list[list[dict]]]:
    """(configs, per rank its results: one dict per case), one CP group of `size` processes for every case."""
    folders = [build(tmp_path_factory.mktemp(case), case) for case in cases]
    out = tmp_path_factory.mktemp(f"cp{size}-out")
    addr = free_init_addr()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.cp_worker", str(r), str(size), addr, str(out),
                               *folders], cwd=REPO, env=env) for r in range(size)]
    try:
        assert [p.wait(600) for p in procs] == [0] * size
    finally:
        for p in procs:
            p.kill()
    configs = [ModelConfig.from_hf(read_hf_config(f)) for f in folders]
    return configs, [torch.load(out / f"rank{r}.pt") for r in range(size)]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return run_group(tmp_path_factory, 2, CASES)


@pytest.fixture(scope="module")
def group4(tmp_path_factory):
    """CP=4 on the 3-layer Llama and glm_moe_dsa: rank 3 owns no layer (LayerSplit: its scratch only), 4-way padding."""
    return run_group(tmp_path_factory, 4, CASES4)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max()) if b.numel() else 0.0


def is_hit(step: dict) -> bool:
    """The suffix prefill after the radix hit: 7 new tokens over a 64-token cached prefix."""
    return step["query_lens"] == [7] and step["context_lens"] == [71]


def token_bytes(c: ModelConfig) -> int:
    """K and V of one token in one layer, fp32 (MLA: the one latent head, kv_lora_rank + rope, no V)."""
    heads, dim, latent = c.kv_shape
    return (1 if latent else 2) * heads * dim * 4


def full_layers(c: ModelConfig) -> tuple[int, ...]:
    """The DSA full indexer layers (none without DSA)."""
    return c.dsa.full_layers if c.dsa is not None else ()


def index_bytes(c: ModelConfig) -> int:
    """One token's index key in one full DSA layer, fp32."""
    return c.dsa.index_head_dim * 4 if c.dsa is not None else 0


def prefix_pages(step: dict) -> int:
    """Distinct pages holding the step's cached prefixes (context before its new tokens)."""
    pages = set()
    for q, ctx, lst in zip(step["query_lens"], step["context_lens"], step["page_lists"]):
        pages.update(lst[:-(-(ctx - q) // PAGE)])
    return len(pages)


def check_logits_and_tokens(ranks: list[list[dict]], index: int, mode: str) -> None:
    """Logits within 1e-5 relative and greedy tokens equal to CP=1; every rank's logits bit-identical to rank 0's."""
    result, ref = ranks[0][index][mode], ranks[0][index]["ref"]
    assert [s["query_lens"] for s in result["steps"]] == [s["query_lens"] for s in ref["steps"]]
    lengths = {q for s in ref["steps"] for q in s["query_lens"]}
    assert {26, 11, 20, 32, 7} <= lengths and any(is_hit(s) for s in ref["steps"])  # odd, even, chunked, hit
    for step, want in zip(result["steps"], ref["steps"]):
        assert step["logits"].shape == want["logits"].shape
        assert rel_err(step["logits"], want["logits"]) <= 1e-5
    assert result["tokens"] == ref["tokens"]
    for other in ranks[1:]:
        for a, b in zip(result["steps"], other[index][mode]["steps"]):
            assert torch.equal(a["logits"], b["logits"])


def check_kv_bytes(c: ModelConfig, ranks: list[list[dict]], index: int) -> None:
    """S0 = L * S * b per rank without LayerSplit; S1 = (n_r + 1) * S * b with it (b: one token's K and V); DSA adds
    S * b_I per full layer (S0) or per storage layer holding one (S1: its own full layers and the scratch)."""
    for rank, results in enumerate(ranks):
        plain, split = results[index]["plain"], results[index]["layer_split"]
        slots = plain["num_pages"] * PAGE
        full = full_layers(c)
        assert plain["kv_bytes"] == (c.num_layers * token_bytes(c) + len(full) * index_bytes(c)) * slots
        owned = owned_layers(c.num_layers, len(ranks), rank)
        stored_full = len({layer if layer in owned else "scratch" for layer in full})
        assert split["num_pages"] == plain["num_pages"]
        assert split["kv_bytes"] == ((len(owned) + 1) * token_bytes(c) + stored_full * index_bytes(c)) * slots
    assert ranks[0][index]["ref"]["kv_bytes"] == ranks[0][index]["plain"]["kv_bytes"]


def check_collective_bytes(c: ModelConfig, ranks: list[list[dict]], index: int, mode: str) -> None:
    """Per split step of N tokens: L all-gathers of ceil(N/R) * b bytes (the new KV) and one of K * V * 4 (logits,
    K = most logit rows on one rank); per unsplit (decode) step none. LayerSplit adds per layer one broadcast of
    P_pages * page_size * b bytes, counted on every rank (the owner sends it, the others receive it). A DSA full layer
    adds one all-gather of ceil(N/R) * b_I and one broadcast of P_pages * page_size * b_I (its index keys)."""
    size, full = len(ranks), len(full_layers(c))
    per_token = c.num_layers * token_bytes(c) + full * index_bytes(c)          # over all layers
    for results in ranks:
        for step in results[index][mode]["steps"]:
            n, rows = step["num_tokens"], step["logit_rows"]
            want_calls, want_bytes = {}, {}
            if max(step["query_lens"]) > 1:
                k = max(sum(1 for r in rows if r % size == j) for j in range(size))
                want_calls["all_gather"] = c.num_layers + full + (1 if k else 0)
                want_bytes["all_gather"] = -(-n // size) * per_token + k * c.vocab_size * 4
            pages = prefix_pages(step)
            if mode == "layer_split" and pages:
                want_calls["broadcast"] = c.num_layers + full
                want_bytes["broadcast"] = pages * PAGE * per_token
            assert step["calls"] == want_calls
            assert step["bytes"] == want_bytes


def check_export(c: ModelConfig, ranks: list[list[dict]], index: int) -> None:
    """A PD prefill worker's export_kv of every page the steps used: under LayerSplit rank 0 receives the other ranks'
    layers, pages * page_size * ((L - n_0) * b + (F - f_0) * b_I) bytes (F full DSA layers, f_0 of them rank 0's),
    and sends plain CP's bytes, whose KV is the one process's within 1e-5."""
    plain, split, ref = (ranks[0][index][mode] for mode in ("plain", "layer_split", "ref"))
    assert split["export_pages"] == plain["export_pages"] == ref["export_pages"] > 8
    assert split["export"] == plain["export"] and len(plain["export"]) == len(ref["export"])
    assert rel_err(*(torch.frombuffer(bytearray(m["export"]), dtype=torch.float32) for m in (plain, ref))) <= 1e-5
    owned = owned_layers(c.num_layers, len(ranks), 0)
    others = (c.num_layers - len(owned)) * token_bytes(c) + sum(i not in owned for i in full_layers(c)) * index_bytes(c)
    assert split["export_comm"]["bytes"]["recv"] == split["export_pages"] * PAGE * others
    assert plain["export_comm"] == {"calls": {}, "bytes": {}}


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_layer_split_export_gathers_every_layer_at_rank_0(group, index):
    check_export(group[0][index], group[1], index)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_cp2_logits_and_greedy_tokens_equal_cp1(group, index, mode):
    check_logits_and_tokens(group[1], index, mode)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_kv_bytes_equal_the_formulas(group, index):
    check_kv_bytes(group[0][index], group[1], index)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_collective_bytes_equal_the_formulas(group, index, mode):
    check_collective_bytes(group[0][index], group[1], index, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index", range(len(CASES4)), ids=CASES4)
def test_cp4_equals_cp1_with_exact_bytes(group4, index, mode):
    check_logits_and_tokens(group4[1], index, mode)
    check_kv_bytes(group4[0][index], group4[1], index)
    check_collective_bytes(group4[0][index], group4[1], index, mode)
    check_export(group4[0][index], group4[1], index)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_layer_split_waits_for_the_kv_before_attention(group, index):
    c = group[0][index]
    for results in group[1]:
        for step in results[index]["layer_split"]["steps"]:
            split = max(step["query_lens"]) > 1
            index_first = (["broadcast index_k"] + (["all_gather new index_k"] if split else [])
                           + ["wait index_k"])                    # a DSA full layer: the indexer's keys first
            after = ["indexer"] if c.dsa is not None else []      # the indexer scores while the KV broadcast runs
            kv = ["broadcast kv"] + after + (["all_gather new kv"] if split else []) + ["wait kv", "attention"]
            assert step["events"] == [(layer, e) for layer in range(c.num_layers)
                                      for e in (index_first if layer in full_layers(c) else []) + kv]


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_a_dropped_kv_wait_gives_wrong_logits(group, index):
    """The fault lets attention read the scratch (NaN where the broadcast would land) before the owner's broadcast
    lands: the radix-hit step (its 64 cached tokens come only by broadcast) is wrong; one with nothing cached exact."""
    dropped, ref = group[1][0][index]["dropped_wait"], group[1][0][index]["ref"]
    hit = [i for i, s in enumerate(ref["steps"]) if is_hit(s)][0]
    logits = dropped["steps"][hit]["logits"]
    assert not torch.isfinite(logits).all() or rel_err(logits, ref["steps"][hit]["logits"]) > 1e-2
    assert rel_err(dropped["steps"][0]["logits"], ref["steps"][0]["logits"]) <= 1e-5
    assert all(e != "wait kv" for _, e in dropped["steps"][hit]["events"])


@pytest.mark.parametrize("layer_split", [False, True])
def test_serving_path_starts_and_stops_its_follower(tmp_path, layer_split):
    """load_runner (what `serve --cp-size 2` and LLM(cp_size=2) call) on this process as rank 0: the same greedy tokens
    as CP=1, and close() ends the follower process with code 0."""
    import dataclasses

    from radixserve.engine_config import EngineConfig
    from radixserve.runner.tp import load_runner
    from tests.model.cp_worker import generate

    build_tiny_llama(tmp_path, num_hidden_layers=3, tie_word_embeddings=False)
    config = EngineConfig(model_path=str(tmp_path), cp_size=2, enable_layer_split=layer_split, max_total_tokens=4096,
                          quantization="none", chunked_prefill_size=32, num_threads=1)
    runner = load_runner(config)
    try:
        assert runner.info()["cp_size"] == 2 and runner.info()["layer_split"] == layer_split
        tokens = generate(runner)
    finally:
        runner.close()
    assert [p.returncode for p in runner.followers.processes] == [0]
    assert tokens == generate(load_runner(dataclasses.replace(config, cp_size=1, enable_layer_split=False)))


def test_a_killed_follower_ends_rank_0s_step_with_an_error(tmp_path):
    """C54 under CP: rank 1 dies between steps; rank 0's next step raises DistError (no hang), close() returns."""
    from radixserve.dist.comm import DistError
    from radixserve.engine_config import EngineConfig
    from radixserve.runner.tp import load_runner
    from tests.model.cp_worker import generate

    build_tiny_llama(tmp_path, num_hidden_layers=3, tie_word_embeddings=False)
    runner = load_runner(EngineConfig(model_path=str(tmp_path), cp_size=2, enable_layer_split=True,
                                      max_total_tokens=4096, quantization="none", num_threads=1, dist_timeout=30))
    try:
        follower = runner.followers.processes[0]
        follower.kill()
        follower.wait(60)
        with pytest.raises(DistError, match="rank 0"):
            generate(runner)
    finally:
        runner.close()
