"""--ep-size: the combinations EngineConfig and the model refuse, the expert layout of layers/parallel.py's
shard_experts, and (in one process, no torch.distributed) that the ranks' partial expert outputs sum to the
unsplit layer's for every layout of 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.layers.parallel import ExpertShard, shard_experts
from radixserve.models.block_config import MoEConfig
from radixserve.models.moe import PROJECTIONS, Experts, Router


class Rank:
    """A stand-in for the group: rank and size only (no collective is called here)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep_size=2), "--ep-size 2 must be a positive divisor of --tp-size 1"),
    (dict(tp_size=4, ep_size=3), "--ep-size 3 must be a positive divisor of --tp-size 4"),
    (dict(tp_size=2, ep_size=4), "--ep-size 4 must be a positive divisor of --tp-size 2"),
    (dict(tp_size=2, ep_size=0), "--ep-size 0"),
    (dict(cp_size=2, ep_size=2), "--ep-size 2 must be a positive divisor of --tp-size 1"),
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_accepted():
    assert EngineConfig(tp_size=4, ep_size=2).ep_size == 2
    assert EngineConfig(tp_size=2, ep_size=2, nnodes=2, dist_init_addr="h:1").ep_size == 2


def test_layout_is_sglangs_expert_rank_major():
    # ep = size: whole experts, contiguous
    assert [shard_experts(8, 32, Rank(r, 2), 2) for r in range(2)] == [ExpertShard(0, 4, 0, 32),
                                                                        ExpertShard(4, 4, 0, 32)]
    # ep 1: plain TP, every expert sliced
    assert [shard_experts(8, 32, Rank(r, 2), 1) for r in range(2)] == [ExpertShard(0, 8, 0, 16),
                                                                        ExpertShard(0, 8, 16, 16)]
    # tp 4, ep 2: ranks 0, 1 hold experts 0-3 (rows 0-15, 16-31), ranks 2, 3 experts 4-7
    assert [shard_experts(8, 32, Rank(r, 4), 2) for r in range(4)] == [
        ExpertShard(0, 4, 0, 16), ExpertShard(0, 4, 16, 16), ExpertShard(4, 4, 0, 16), ExpertShard(4, 4, 16, 16)]
    assert shard_experts(8, 32, None) == ExpertShard(0, 8, 0, 32)


@pytest.mark.parametrize("args, message", [
    ((6, 32, Rank(0, 4), 4), "--ep-size 4 does not divide the 6 routed experts"),
    ((8, 30, Rank(0, 4), 1), "does not divide the experts' intermediate size 30"),
    ((8, 32, Rank(0, 4), 3), "--ep-size 3 must divide --tp-size 4"),
    ((8, 32, None, 2), "--ep-size 2 needs --tp-size"),
])
def test_layout_refusals(args, message):
    with pytest.raises(ValueError, match=message):
        shard_experts(*args)


def moe_config() -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=3, intermediate_size=32, scoring="softmax", norm_topk_prob=True)


def loaded_experts(rank, ep_size: int, checkpoint: dict[str, torch.Tensor]) -> Experts:
    """Experts of one rank, every checkpoint expert offered to load_expert as the loader does."""
    experts = Experts(16, moe_config(), rank, ep_size)
    for name, tensor in checkpoint.items():
        expert, projection = name.split(".")
        experts.load_expert(int(expert), projection, tensor)
    return experts


@pytest.mark.parametrize("size, ep_size", [(2, 2), (2, 1), (4, 4), (4, 2), (4, 1)])
def test_rank_partial_outputs_sum_to_the_unsplit_layer(size, ep_size):
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (32, 16), "up_proj": (32, 16), "down_proj": (16, 32)}
    checkpoint = {f"{e}.{p}": torch.randn(shapes[p], generator=gen) for e in range(8) for p in PROJECTIONS}
    router = Router(16, moe_config())
    router.weight.data.copy_(torch.randn(8, 16, generator=gen))
    x = torch.randn(11, 16, generator=gen)
    weights, ids = router(x)
    full = loaded_experts(None, 1, checkpoint)
    parts = [loaded_experts(Rank(r, size), ep_size, checkpoint) for r in range(size)]
    torch.testing.assert_close(sum(p(x, weights, ids) for p in parts), full(x, weights, ids), rtol=1e-5, atol=1e-6)
    # each rank holds only its experts' bytes: together the whole layer once
    assert sum(p.gate_up.nbytes + p.down.nbytes for p in parts) == full.gate_up.nbytes + full.down.nbytes
    first = parts[-1].first
    assert parts[-1].checkpoint_names()[0] == f"{first}.gate_proj"


def test_a_token_routed_only_to_other_ranks_experts_adds_zero():
    experts = Experts(16, moe_config(), Rank(0, 2), 2)    # experts 0-3
    experts.gate_up.data.normal_()
    experts.down.data.normal_()
    x = torch.randn(2, 16)
    ids = torch.tensor([[4, 5, 7], [0, 6, 5]])
    out = experts(x, torch.full((2, 3), 1 / 3), ids)
    assert torch.equal(out[0], torch.zeros(16)) and out[1].abs().sum() > 0


def test_a_dense_model_refuses_expert_parallelism(tmp_path):
    from radixserve.models.llama import LlamaForCausalLM
    from radixserve.models.model_config import ModelConfig
    from radixserve.weights.safetensors import read_hf_config
    from tests.conftest import build_tiny_llama

    build_tiny_llama(tmp_path)
    config = ModelConfig.from_hf(read_hf_config(str(tmp_path)))
    with pytest.raises(ValueError, match="--ep-size 2 needs a mixture-of-experts model"):
        LlamaForCausalLM(config, Rank(0, 2), ep_size=2)
