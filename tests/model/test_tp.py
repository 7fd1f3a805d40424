"""Tensor parallelism, TP=2 over gloo in 2 processes vs TP=1, on each family's tiny config (tests/model/tp_worker.py).

Checked: logits within 1e-5 relative and greedy tokens equal; both ranks' logits bit-identical; a vocabulary of 257
(not divisible by 2, tied embeddings, one KV head replicated, row-parallel biases: C55); per-rank parameter bytes and
per-step collective bytes equal docs/parallel.md's formulas exactly; the serving path (`load_runner`) starts and
stops its follower process."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from radixserve.models.block_config import MoEConfig
from radixserve.models.model_config import ModelConfig
from radixserve.runner.tp import free_init_addr
from radixserve.weights.safetensors import read_hf_config
from tests.conftest import build_tiny_llama
from tests.model.test_families import build_family

REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = ("llama257", "qwen3", "glm", "glm4", "glm4_moe", "qwen3_moe")


def randomize_biases(folder: pathlib.Path) -> None:
    """transformers initialises biases to zero, which would hide a bias added on both ranks."""
    from safetensors.torch import load_file, save_file

    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.1
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(folders, rank 0's results, rank 1's results), one TP=2 group for every case."""
    folders = []
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        if case == "llama257":
            build_tiny_llama(folder, vocab_size=257, num_key_value_heads=1, attention_bias=True, mlp_bias=True)
            randomize_biases(folder)
        else:
            build_family(folder, case)
        folders.append(str(folder))
    return (folders, *run_group(tmp_path_factory.mktemp("tp-out"), folders))


def run_group(out: pathlib.Path, folders: list[str], ep_size: int = 1, tp_size: int = 2) -> tuple[list[dict], ...]:
    """Each rank's results (rank order) of one tests/model/tp_worker.py group of tp_size processes over `folders`."""
    addr = free_init_addr()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.tp_worker", str(r), addr, str(out), str(tp_size),
                               str(ep_size), *folders], cwd=REPO, env=env) for r in range(tp_size)]
    try:
        assert [p.wait(600) for p in procs] == [0] * tp_size
    finally:
        for p in procs:
            p.kill()
    return tuple(torch.load(out / f"rank{r}.pt") for r in range(tp_size))


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_tp2_logits_and_greedy_tokens_equal_tp1(group, index):
    assert_matches_tp1(group[1][index])


def assert_matches_tp1(rank0: dict) -> None:
    """Rank 0's logits within 1e-5 relative of the TP=1 run's, step by step, and its greedy tokens equal."""
    assert len(rank0["steps"]) == len(rank0["ref_steps"])
    for step, ref in zip(rank0["steps"], rank0["ref_steps"]):
        assert step["logits"].shape == ref["logits"].shape     # the full vocabulary, padding cut
        err = (step["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()
        assert err <= 1e-5, err
    assert rank0["tokens"] == rank0["ref_tokens"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_both_ranks_bit_identical(group, index):
    assert_bit_identical(group[1][index], group[2][index])


def assert_bit_identical(rank0: dict, rank1: dict) -> None:
    assert len(rank0["steps"]) == len(rank1["steps"])
    for a, b in zip(rank0["steps"], rank1["steps"]):
        assert torch.equal(a["logits"], b["logits"])


def expert_bytes(m: MoEConfig, h: int, tp: int, ep: int = 1) -> int:
    """docs/parallel.md: one MoE layer's routed-expert fp32 bytes on one rank: E / ep experts of I * ep / tp rows."""
    return 4 * (m.num_experts // ep) * 3 * (m.intermediate_size * ep // tp) * h


def layer_bytes(c: ModelConfig, tp: int, i: int, ep: int = 1) -> int:
    """docs/parallel.md: fp32 parameter bytes of decoder layer `i` on one rank at tensor parallelism tp, ep
    expert-parallel."""
    h, d = c.hidden_size, c.head_dim
    heads, kv, inter = c.num_heads // tp, max(1, c.num_kv_heads // tp), c.intermediate_size // tp
    qkv = (heads + 2 * kv) * d
    attention = 2 * h + (mla_attention(c, tp, i) if c.mla else
                         (2 * d if c.qk_norm else 0) + (2 * h if c.post_norms else 0)
                         + qkv * h + (qkv if c.qkv_bias else 0) + h * heads * d + (h if c.o_bias else 0))

    def mlp(width: int) -> int:
        return 3 * width * h + ((2 * width + h) if c.mlp_bias else 0)

    if c.moe is None or i in c.moe.dense_layers:
        return 4 * (attention + mlp(inter))
    m, width = c.moe, c.moe.intermediate_size // tp
    shared = mlp(width * m.num_shared_experts) if m.num_shared_experts else 0
    return 4 * (attention + m.num_experts * h + (m.num_experts if m.scoring == "sigmoid" else 0)
                + expert_bytes(m, h, tp, ep) // 4 + shared)


def mla_attention(c: ModelConfig, tp: int, i: int) -> int:
    """docs/parallel.md: MLA/DSA attention parameters (fp32 values) of layer `i` on one rank: the q and kv LoRA
    down-projections and norms (and the DSA indexer of a full layer) replicated, q_b/kv_b by H / tp heads' rows,
    o_proj by their columns."""
    m, h, heads = c.mla, c.hidden_size, c.num_heads // tp
    bias = c.qkv_bias
    q = (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * (m.q_lora_rank or h)
         + ((h + bias + 1) * m.q_lora_rank if m.q_lora_rank else 0))
    kv = (h + bias) * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
    o = heads * m.v_head_dim * h + (h if c.o_bias else 0)
    x = c.dsa
    indexer = (x.index_n_heads * (x.index_head_dim * m.q_lora_rank + h) + (h + 2) * x.index_head_dim
               if x is not None and i in x.full_layers else 0)     # wq_b, weights_proj; wk, k_norm
    return q + kv + kv_b + o + indexer


def param_bytes(c: ModelConfig, tp: int, ep: int = 1) -> int:
    """docs/parallel.md: per-rank fp32 parameter bytes of a decoder at tensor parallelism tp, ep expert-parallel."""
    vocab = -(-c.vocab_size // tp)
    embeddings = 4 * (vocab * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size)
    return embeddings + sum(layer_bytes(c, tp, i, ep) for i in range(c.num_layers))


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_parameter_and_collective_bytes_equal_the_formulas(group, index):
    config = ModelConfig.from_hf(read_hf_config(group[0][index]))
    for rank in (1, 2):
        result = group[rank][index]
        assert result["param_bytes"] == param_bytes(config, 2)
        assert_collective_bytes(config, result["steps"])
    assert param_bytes(config, 1) < 2 * group[1][index]["param_bytes"]     # replicated norms (and KV heads)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_pd_export_gathers_every_kv_head_at_rank_0(group, index):
    assert_export(ModelConfig.from_hf(read_hf_config(group[0][index])), group[1][index])


def assert_export(config: ModelConfig, rank0: dict, tp: int = 2) -> None:
    """A TP prefill worker's export_kv of every page used: every KV head at rank 0, within 1e-5 of TP=1's; GQA: rank 0
    receives n * page_size * L * 2 * (KV - KV_0) * D * 4 bytes (KV_0 its own heads; a replicated head is not sent),
    MLA: no collective (the latent is replicated)."""
    got, want = rank0["export"], rank0["ref_export"]
    assert got["num_pages"] == want["num_pages"] > 2 and len(got["data"]) == len(want["data"])
    a, b = (torch.frombuffer(bytearray(e["data"]), dtype=torch.float32) for e in (got, want))
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    heads, dim, latent = config.kv_shape
    received = got["num_pages"] * got["page_size"] * config.num_layers * 2 * (heads - max(heads // tp, 1)) * dim * 4
    assert got["calls"] == ({} if latent else {"broadcast_object": 1, **({"recv": 2 * (tp - 1)} if received else {})})
    assert got["bytes"].get("recv", 0) == (0 if latent else received)


def assert_collective_bytes(config: ModelConfig, steps: list[dict], tp: int = 2) -> None:
    """Per step at tp ranks: 1 + 2L all-reduces of T·h·4 bytes, one all-gather of R·ceil(V/tp)·4
    (docs/parallel.md)."""
    h, layers, vocab_part = config.hidden_size, config.num_layers, -(-config.vocab_size // tp)
    for step in steps:
        t, r = step["num_tokens"], step["logits"].shape[0]
        assert step["calls"] == {"all_reduce": 1 + 2 * layers, "all_gather": 1}
        assert step["bytes"] == {"all_reduce": (1 + 2 * layers) * t * h * 4, "all_gather": r * vocab_part * 4}


def test_serving_path_starts_and_stops_its_follower(group):
    """load_runner (what `serve --tp-size 2` and LLM(tp_size=2) call) on this process as rank 0: the same greedy
    tokens as TP=1, and close() ends the follower process with code 0."""
    import dataclasses

    from radixserve.engine_config import EngineConfig
    from radixserve.runner.tp import load_runner
    from tests.model.tp_worker import generate

    config = EngineConfig(model_path=group[0][0], tp_size=2, max_total_tokens=4096, quantization="none",
                          chunked_prefill_size=32, num_threads=1)
    runner = load_runner(config)
    try:
        runner.check_group()                    # an idle engine's probe: the follower drops it and follows on
        tokens = generate(runner)
    finally:
        runner.close()
    assert [p.returncode for p in runner.followers.processes] == [0]
    assert tokens == generate(load_runner(dataclasses.replace(config, tp_size=1)))


def test_a_killed_follower_ends_rank_0s_step_with_an_error(group):
    """C54: rank 1 dies between steps; rank 0's idle probe and next step raise DistError (no hang), and close()
    still returns."""
    from radixserve.dist.comm import DistError
    from radixserve.engine_config import EngineConfig
    from radixserve.runner.tp import load_runner
    from tests.model.tp_worker import generate

    runner = load_runner(EngineConfig(model_path=group[0][1], tp_size=2, max_total_tokens=4096, quantization="none",
                                      num_threads=1, dist_timeout=30))
    try:
        follower = runner.followers.processes[0]
        follower.kill()
        follower.wait(60)
        with pytest.raises(DistError, match="rank 0"):
            runner.check_group()                # found while idle, before any request
        with pytest.raises(DistError, match="rank 0"):
            generate(runner)
    finally:
        runner.close()
