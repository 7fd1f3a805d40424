"""GLM-4.7-Flash's MLA (glm4_moe_lite, models/mla.py) on the latent KV layout: every position's logits against
transformers, the pool's bytes per token against docs/mla.md's formula, and the host and disk tiers and the PD
transfer carrying the latent. The five scheduling scenarios run in test_families.py."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner.batch import build_step
from radixserve.runner.kv_sizing import num_pages
from radixserve.runner.kv_transfer import pack_pages, unpack_pages
from radixserve.runner.model_runner import ModelRunner
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_hicache_model import SMALL_POOL, assert_same, generate, rounds, sessions
from tests.model.test_parity import make_engine
from tests.model.test_runner import Seq

BASE = FAMILIES["glm4_moe_lite"][2]
# name -> config kwargs over BASE: q LoRA or not, interleaved (released) or half-split rope.
VARIANTS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}, "half_split_rope": {"rope_interleave": False}}
ATOL = 1e-4


def build_mla(folder, vocab_size: int = 512, **extra):
    spec = ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", {**BASE, "vocab_size": vocab_size, **extra})
    return build_family(folder, "glm4_moe_lite", seed=1, spec=spec)


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    return build_mla(tmp_path_factory.mktemp("mla"))


def forward_logits(runner: ModelRunner, seq: Seq, n: int) -> torch.Tensor:
    """The next n tokens of `seq` as one step; logits of every row, (n, V) fp32."""
    step = build_step([seq.chunk(n)], runner.page_size, runner.device)
    logits = runner.model(step.input_ids, step.positions, runner.backend.prepare(step), None)
    seq.computed += n
    return logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.inference_mode()
def test_logits_equal_transformers_at_every_position(tmp_path, variant):
    """A prompt in three chunks (the later ones read the cached latent through the page table), then decodes:
    every position's full logit row within 1e-4 of transformers' one forward over the whole sequence."""
    from transformers import AutoModelForCausalLM

    folder = build_mla(tmp_path, **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=16, max_total_tokens=512))
    rng = random.Random(0)
    seq = Seq("a", [rng.randrange(3, 512) for _ in range(70)], [7, 2, 30, 11, 5, 19])
    ours = [forward_logits(runner, seq, n) for n in (30, 17, 23)]
    for _ in range(6):
        seq.output.append(int(ours[-1][-1].argmax()))
        ours.append(forward_logits(runner, seq, 1))
    ref = hf(torch.tensor([seq.tokens])).logits[0, :seq.computed]
    assert float((torch.cat(ours) - ref).abs().max()) <= ATOL


@pytest.mark.parametrize("dtype,kv_dtype,width", [("float32", "auto", 4), ("bfloat16", "auto", 2),
                                                   ("float32", "fp8_e4m3", 1)])
def test_pool_bytes_per_token_per_layer_are_latent_plus_rope(mla_dir, dtype, kv_dtype, width):
    """docs/mla.md: (kv_lora_rank + qk_rope_head_dim) x dtype bytes per token per layer, and no V."""
    runner = ModelRunner.from_config(EngineConfig(model_path=str(mla_dir), dtype=dtype, kv_cache_dtype=kv_dtype,
                                                  max_total_tokens=512, page_size=16))
    mla, kv = runner.model_config.mla, runner.kv
    slots = kv.num_pages * kv.page_size
    assert kv.allocated_bytes() == slots * kv.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * width
    assert kv.token_bytes * slots == kv.allocated_bytes()
    gib = EngineConfig(model_path=str(mla_dir), dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory_gb=0.001)
    per_token = runner.model_config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * width
    assert num_pages(gib, runner.model_config) == int(0.001 * 2**30) // (per_token * gib.page_size)


@torch.inference_mode()
def test_fp8_latent_reads_the_same_values_on_every_path(mla_dir):
    """--kv-cache-dtype fp8_e4m3 on the latent (C38 for MLA): chunks and decodes read what one prefill over the same
    tokens reads; the quantisation is real (logits move off fp32 KV) and bounded."""
    logits = {}
    for kv_dtype in ("fp8_e4m3", "auto"):
        runner = ModelRunner.from_config(EngineConfig(model_path=str(mla_dir), page_size=16, max_total_tokens=512,
                                                      kv_cache_dtype=kv_dtype))
        rng = random.Random(4)
        stepped = Seq("a", [rng.randrange(3, 512) for _ in range(40)], [3, 9, 1, 14])
        parts = [forward_logits(runner, stepped, n) for n in (25, 15)]
        for _ in range(5):
            stepped.output.append(int(parts[-1][-1].argmax()))
            parts.append(forward_logits(runner, stepped, 1))
        whole = Seq("b", stepped.tokens, [20, 21, 22, 23])
        logits[kv_dtype] = (torch.cat(parts), forward_logits(runner, whole, len(whole.tokens)))
    fp8, whole = logits["fp8_e4m3"]
    assert float((fp8 - whole).abs().max()) <= 1e-5
    drift = float((fp8 - logits["auto"][0]).abs().max())
    assert 1e-4 < drift < 0.1 * float(logits["auto"][0].abs().max()), drift


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_reloads_the_latent(mla_dir, policy):
    prompts = sessions()
    off = rounds(make_engine(mla_dir, **SMALL_POOL), prompts)
    engine = make_engine(mla_dir, enable_hierarchical_cache=True, hicache_write_policy=policy, **SMALL_POOL)
    on = rounds(engine, prompts)
    for a, b in zip(off, on):
        assert_same(a, b)
    stats = engine.stats()
    assert stats["hicache_loads"] > 0 and stats["hicache_failed_loads"] == 0
    assert engine.runner.host_kv.page_bytes == engine.runner.kv.token_bytes * 16
    engine.check_invariants()


def test_disk_tier_restart_reads_the_latent_back(mla_dir, tmp_path):
    prompts = sessions(n=2, seed=3)
    off = generate(make_engine(mla_dir, **SMALL_POOL), prompts, "r")
    cfg = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path), **SMALL_POOL}
    first = make_engine(mla_dir, **cfg)
    generate(first, prompts, "a")
    first.runner.host_kv.disk.flush()
    engine = make_engine(mla_dir, **cfg)
    assert_same(off, generate(engine, prompts, "b"))
    assert engine.stats()["hicache_disk_fetch_pages"] > 0


def test_pd_bytes_carry_only_the_latent(mla_dir):
    """export -> bytes -> import into another worker's cache gives the same pages; V adds no bytes."""
    runner = make_engine(mla_dir, **SMALL_POOL).runner
    pages, kv = list(range(4)), runner.kv
    for layer in range(kv.num_layers):
        k = torch.randn(64, 1, kv.head_dim)
        kv.write(layer, torch.arange(64), k, k)
    data = runner.export_kv(pages)
    assert len(data) == runner.kv.token_bytes * 16 * len(pages)
    other = make_engine(mla_dir, **SMALL_POOL).runner
    other.import_kv([9, 3, 5, 1], data, foreign=True)
    mine, theirs = runner.kv.export_pages(pages), other.kv.export_pages([9, 3, 5, 1])
    assert torch.equal(mine.k, theirs.k) and theirs.v.numel() == 0
    assert torch.equal(unpack_pages(other.kv, 4, pack_pages(theirs)).k, mine.k)
