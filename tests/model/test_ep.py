"""Expert parallelism, TP=2 with --ep-size 2 over gloo in 2 processes vs one process, on the MoE families' tiny
configs (tests/model/tp_worker.py, test_tp.py's checks).

Each rank holds 4 of the 8 routed experts whole. Checked: logits within 1e-5 relative and greedy tokens equal; both
ranks' logits bit-identical; per-rank routed-expert and total parameter bytes equal docs/parallel.md's formulas
exactly (half the experts, every row), and the collectives are TP's (one all-reduce per MoE layer, no new traffic);
the serving path (`load_runner`) with --ep-size 2. glm_moe_dsa (MLA + DSA) runs under EP as under TP
(test_tp_mla.py): its heads split, its latent and indexer replicated, its experts whole."""
from __future__ import annotations

import pytest

from radixserve.models.model_config import ModelConfig
from radixserve.weights.safetensors import read_hf_config
from tests.model.test_families import build_family
from tests.model.test_tp import (assert_bit_identical, assert_collective_bytes, assert_matches_tp1, expert_bytes,
                                 param_bytes, run_group)

CASES = ("glm4_moe", "qwen3_moe", "glm_moe_dsa")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(folders, rank 0's results, rank 1's results), one TP=2 EP=2 group for every case."""
    folders = [str(build_family(tmp_path_factory.mktemp(case), case)) for case in CASES]
    return (folders, *run_group(tmp_path_factory.mktemp("ep-out"), folders, ep_size=2))


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_ep2_logits_and_greedy_tokens_equal_one_process(group, index):
    assert_matches_tp1(group[1][index])


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_both_ranks_bit_identical(group, index):
    assert_bit_identical(group[1][index], group[2][index])


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASES)
def test_expert_parameter_and_collective_bytes_equal_the_formulas(group, index):
    config = ModelConfig.from_hf(read_hf_config(group[0][index]))
    moe_layers = config.num_layers - len(config.moe.dense_layers)
    per_layer = expert_bytes(config.moe, config.hidden_size, tp=2, ep=2)
    assert per_layer == 4 * (config.moe.num_experts // 2) * 3 * config.moe.intermediate_size * config.hidden_size
    assert per_layer == expert_bytes(config.moe, config.hidden_size, tp=1) // 2    # half of TP=1's, as TP=2's
    for rank in (1, 2):
        result = group[rank][index]
        assert result["expert_bytes"] == moe_layers * per_layer
        assert result["param_bytes"] == param_bytes(config, 2, ep=2) == param_bytes(config, 2)
        assert_collective_bytes(config, result["steps"])


def test_serving_path_with_expert_parallelism(group):
    """load_runner (what `serve --tp-size 2 --ep-size 2` calls) on this process as rank 0, on glm_moe_dsa (MLA + DSA):
    the follower loads the other experts (the config travels to it), greedy tokens equal one process's, and close()
    ends it with 0."""
    import dataclasses

    from radixserve.engine_config import EngineConfig
    from radixserve.runner.tp import load_runner
    from tests.model.tp_worker import generate

    config = EngineConfig(model_path=group[0][CASES.index("glm_moe_dsa")], tp_size=2, ep_size=2,
                          max_total_tokens=4096, quantization="none", chunked_prefill_size=32, num_threads=1)
    runner = load_runner(config)
    try:
        assert runner.model.model.layers[1].mlp.experts.gate_up.shape[0] == 4
        tokens = generate(runner)
    finally:
        runner.close()
    assert [p.returncode for p in runner.followers.processes] == [0]
    assert tokens == generate(load_runner(dataclasses.replace(config, tp_size=1, ep_size=1)))

