"""PagedDecodeCall (torch_backend.py), the lean per-layer call of a pure decode step read in place, against the general
path of TorchStepAttention (KVCache.write, kernel_view, decode_attention_paged): bitwise equal outputs and KV pages
for fp32 and bf16 storage, page sizes 1 and 16, one row and a batch (cascade off); taken only where it applies."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.runner.attention import decode_kernel
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.batch import build_step
from radixserve.runner.kv_cache import FP8_DTYPES, KVCache
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not decode_kernel.supported_isas(), reason="radixserve/csrc not built")
LAYERS, KV, HEADS, DIM, PAGES = 3, 3, 9, 64, 256


def filled_cache(page_size: int, dtype: torch.dtype) -> KVCache:
    """A cache whose every slot holds random K and V (stored `dtype`, fp32 reads)."""
    kv = KVCache(LAYERS, PAGES, page_size, KV, DIM, dtype, compute_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        slots = torch.arange(PAGES * page_size)
        k, v = (torch.randn(len(slots), KV, DIM, generator=gen) for _ in range(2))
        kv.write(layer, slots, k, v)
    return kv


def seq(rid: str, context: int, page_size: int, rng: random.Random) -> ScheduledSeq:
    """The decode of one token at position context - 1 over shuffled pages; a prompt chunk if `rid` starts with p."""
    pages = rng.sample(range(PAGES), -(-context // page_size))
    n = 5 if rid.startswith("p") else 1
    return ScheduledSeq(rid, [7] * n, context - n, pages, True, SamplingParams(), 0, [7] * context, [], 0, None)


def run_layers(backend: TorchAttentionBackend, step, lean: bool) -> list[torch.Tensor]:
    """Every layer's output for random q, k, v (same for both paths), through PagedDecodeCall or the general path."""
    attn = backend.prepare(step)
    assert attn.lean is not None
    if not lean:
        attn.lean = None
    gen = torch.Generator().manual_seed(2)
    outs = []
    for layer in range(LAYERS):
        q = torch.randn(step.num_tokens, HEADS, DIM, generator=gen)
        k, v = (torch.randn(step.num_tokens, KV, DIM, generator=gen) for _ in range(2))
        outs.append(attn(layer, q, k, v))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_lean_call_is_bitwise_the_general_path(page_size, dtype, batch):
    rng = random.Random(page_size + batch)
    step = build_step([seq(f"r{i}", rng.randrange(2, 200), page_size, rng) for i in range(batch)], page_size)
    caches = filled_cache(page_size, dtype), filled_cache(page_size, dtype)
    lean_backend, plain_backend = (TorchAttentionBackend(kv, cascade=False) for kv in caches)
    got, ref = run_layers(lean_backend, step, True), run_layers(plain_backend, step, False)
    for g, r in zip(got, ref):
        assert g.shape == (batch, HEADS * DIM) and torch.equal(g, r)
    for layer in range(LAYERS):
        a, b = caches[0].kernel_view(layer), caches[1].kernel_view(layer)
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_lean_call_only_where_it_applies():
    rng = random.Random(0)
    kv = filled_cache(16, torch.float32)
    backend = TorchAttentionBackend(kv)
    assert backend.prepare(build_step([seq("a", 40, 16, rng)], 16)).lean is not None
    mixed = build_step([seq("p", 30, 16, rng), seq("a", 40, 16, rng)], 16)
    assert backend.prepare(mixed).lean is None                      # a prefill chunk in the step
    batch = build_step([seq("a", 40, 16, rng), seq("b", 20, 16, rng)], 16)
    assert backend.prepare(batch).lean is None                      # cascade on: the mirror
    scales = torch.ones(LAYERS, KV)
    fp8 = KVCache(LAYERS, PAGES, 16, KV, DIM, FP8_DTYPES["fp8_e4m3"], compute_dtype=torch.float32,
                  k_scale=scales, v_scale=scales)
    assert TorchAttentionBackend(fp8).plain_views is None           # FP8: KVCache.write
    assert TorchAttentionBackend(fp8).prepare(build_step([seq("a", 40, 16, rng)], 16)).lean is None
