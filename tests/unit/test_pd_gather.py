"""A PD export gathered at rank 0 (runner/layer_split.py gather_pages, runner/kv_transfer.py gather_kv_heads), ranks as
threads over an in-memory fake of Communicator's point-to-point ops: rank 0's pages equal an unsplit cache's export
bit for bit and the bytes it receives equal docs/disaggregation.md's formulas. Real groups: tests/model/test_cp.py,
test_tp.py; end to end: tests/api/test_pd_cp.py."""
from __future__ import annotations

import queue
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from radixserve.layers.parallel import shard_heads
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.kv_transfer import gather_kv_heads
from radixserve.runner.layer_split import LayerSplit, owned_layers

PAGE, PAGES, HEAD_DIM, INDEX_DIM = 4, 6, 3, 5
PAGE_IDS = [4, 1, 3]


class FakeComm:
    """rank, size, device, send_async / recv over shared queues, and Communicator's "send" / "recv" byte counters."""

    def __init__(self, wire: dict, rank: int, size: int):
        self.wire, self.rank, self.size, self.device = wire, rank, size, torch.device("cpu")
        self.bytes: Counter[str] = Counter()

    def send_async(self, x: torch.Tensor, dst: int):
        self.bytes["send"] += x.nbytes
        self.wire[self.rank, dst].put(x.clone())
        return SimpleNamespace(wait=lambda: None)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        self.bytes["recv"] += x.nbytes
        return x.copy_(self.wire[src, self.rank].get(timeout=10))


def run_ranks(size: int, body) -> tuple[list, list[FakeComm]]:
    """body(comm) on `size` threads, one per rank; (their results, their comms)."""
    wire = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    comms = [FakeComm(wire, r, size) for r in range(size)]
    results = [None] * size

    def run(rank: int) -> None:
        results[rank] = body(comms[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, comms


def cache(layers: int, heads: int, latent: bool, index_layers: list[int]) -> KVCache:
    kv = KVCache(layers, PAGES, PAGE, heads, HEAD_DIM, torch.float32, latent=latent)
    if index_layers:
        kv.add_side_buffer("index_k", (INDEX_DIM,), torch.float32, index_layers)
    return kv


def fill(kv: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor | None) -> None:
    """k, v (slots, KV, D) and keys (slots, Di) into every slot of `layer`."""
    slots = torch.arange(PAGES * PAGE)
    kv.write(layer, slots, k, v)
    if keys is not None:
        kv.write_side("index_k", layer, slots, keys)


@pytest.mark.parametrize("num_layers, size, latent, full", [
    (3, 2, False, ()), (3, 4, False, ()), (3, 2, True, (0, 2)), (5, 4, True, (1, 2, 4)), (3, 4, True, (0, 1, 2))],
    ids=["gqa-l3-cp2", "gqa-l3-cp4-idle-rank", "mla-dsa-l3-cp2", "mla-dsa-l5-cp4", "mla-dsa-l3-cp4"])
def test_layer_split_gather_is_the_unsplit_export(num_layers, size, latent, full):
    heads = 1 if latent else 2
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(num_layers, PAGES * PAGE, heads, HEAD_DIM, generator=gen) for _ in range(2))
    keys = torch.randn(num_layers, PAGES * PAGE, INDEX_DIM, generator=gen)
    ref = cache(num_layers, heads, latent, list(full))
    for layer in range(num_layers):
        fill(ref, layer, k[layer], v[layer], keys[layer] if layer in full else None)

    def rank_export(comm: FakeComm):
        split = LayerSplit(num_layers, comm)
        index_layers = sorted({split.storage(i) for i in full})
        kv = cache(split.num_storage_layers, heads, latent, index_layers)
        for layer in range(num_layers):            # every layer passes through scratch; the owned ones stay
            fill(kv, split.storage(layer), k[layer], v[layer], keys[layer] if layer in full else None)
        stale = keys[0] + 100 if split.scratch in index_layers else None
        fill(kv, split.scratch, k[0] + 100, v[0] + 100, stale)
        return split.gather_pages(kv, PAGE_IDS, {"index_k": full} if full else {})

    got, comms = run_ranks(size, rank_export)
    want = ref.export_pages(PAGE_IDS)
    assert got[1:] == [None] * (size - 1)
    assert torch.equal(got[0].k, want.k) and torch.equal(got[0].v, want.v)
    assert got[0].side.keys() == want.side.keys() and all(torch.equal(got[0].side[n], want.side[n]) for n in want.side)
    owned = owned_layers(num_layers, size, 0)
    b, b_index = (1 if latent else 2) * heads * HEAD_DIM * 4, INDEX_DIM * 4
    others_full = sum(layer not in owned for layer in full)
    assert comms[0].bytes == Counter({"recv": len(PAGE_IDS) * PAGE * ((num_layers - len(owned)) * b
                                                                       + others_full * b_index)})
    assert sum(c.bytes["send"] for c in comms[1:]) == comms[0].bytes["recv"]


@pytest.mark.parametrize("num_kv_heads, size", [(2, 2), (4, 2), (1, 2), (2, 4)],
                         ids=["kv2-tp2", "kv4-tp2", "kv1-tp2-replicated", "kv2-tp4-replicated"])
def test_tp_gather_is_every_kv_head(num_kv_heads, size):
    num_layers, model = 2, SimpleNamespace(num_heads=4, num_kv_heads=num_kv_heads)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(num_layers, PAGES * PAGE, num_kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
    ref = cache(num_layers, num_kv_heads, False, [])
    for layer in range(num_layers):
        fill(ref, layer, k[layer], v[layer], None)

    def rank_export(comm: FakeComm):
        mine = shard_heads(model.num_heads, num_kv_heads, comm)
        heads = slice(mine.kv_start, mine.kv_start + mine.num_kv_heads)
        kv = cache(num_layers, mine.num_kv_heads, False, [])
        for layer in range(num_layers):
            fill(kv, layer, k[layer][:, heads], v[layer][:, heads], None)
        return gather_kv_heads(kv.export_pages(PAGE_IDS), comm, model)

    got, comms = run_ranks(size, rank_export)
    want = ref.export_pages(PAGE_IDS)
    assert got[1:] == [None] * (size - 1)
    assert torch.equal(got[0].k, want.k) and torch.equal(got[0].v, want.v)
    own_heads = max(num_kv_heads // size, 1)
    assert comms[0].bytes["recv"] == len(PAGE_IDS) * PAGE * num_layers * 2 * (num_kv_heads - own_heads) * HEAD_DIM * 4
    assert sum(c.bytes["send"] for c in comms[1:]) == comms[0].bytes["recv"]      # a replicated head is sent once
