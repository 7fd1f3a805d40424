"""--tp-size and its relatives: the combinations EngineConfig refuses at start-up, and the ones it accepts."""
from __future__ import annotations

import pytest

from radixserve.engine_config import EngineConfig
from radixserve.layers.parallel import Heads, shard_heads, vocab_part


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_size=3, nnodes=2), "--nnodes must divide the 3 ranks"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank"),
    (dict(tp_size=2, nnodes=2), "--dist-init-addr"),
    (dict(tp_size=2, dist_timeout=0), "dist_timeout"),
    (dict(tp_size=2, enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(tp_size=2, kv_cache_dtype="fp8_e4m3"), "fp8"),
    (dict(tp_size=2, cp_size=2, disaggregation_mode="decode"), "decode with --tp-size 2 --cp-size 2 is not built"),
    (dict(tp_size=2, speculative_algorithm="draft", speculative_draft_layers=1), "draft"),
    *[(dict(tp_size=3, quantization=q), f"--tp-size 3 cannot be combined with --quantization {q}")
      for q in ("int4", "int8", "int4-int8", "int4-fp32")],
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_accepted():
    c = EngineConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert (c.tp_size, c.nnodes, c.node_rank, c.dist_init_addr) == (4, 2, 1, "10.0.0.1:5000")
    c = EngineConfig(tp_size=2, speculative_algorithm="ngram")
    assert (c.tp_size, c.speculative_algorithm) == (2, "ngram")


class Rank:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    assert [shard_heads(8, 4, Rank(r, 2)) for r in range(2)] == [Heads(4, 2, 0, 0), Heads(4, 2, 4, 2)]
    # 2 KV heads on 4 ranks: ranks 0, 1 hold KV head 0 (q heads 0-3), ranks 2, 3 KV head 1 (q heads 4-7)
    assert [shard_heads(8, 2, Rank(r, 4)).kv_start for r in range(4)] == [0, 0, 1, 1]
    for bad in ((9, 3, 2), (8, 3, 4)):
        with pytest.raises(ValueError, match="does not divide"):
            shard_heads(bad[0], bad[1], Rank(0, bad[2]))


def test_vocab_parts_cover_an_odd_vocabulary():
    assert [vocab_part(257, Rank(r, 2)) for r in range(2)] == [(0, 129), (129, 129)]   # row 257 is padding
    assert [vocab_part(1003, Rank(r, 3)) for r in range(3)] == [(0, 335), (335, 335), (670, 335)]
