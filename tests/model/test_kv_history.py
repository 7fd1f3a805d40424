"""--kv-history-dtype auto: history pages at the model dtype, decode pages in FP8 (case C39's guard, docs/runner.md).

Against an all-model-dtype server on the same tiny random model: prompt logprobs equal exactly; the pages a decode
writes are stored as FP8; a second turn hits only the model-dtype history and its first token's logprobs equal
the reference's for the same prompt (all-FP8 KV differs); pages never leak through preemption and aborts; bad flag
combinations are refused with a message naming them."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.mixed_kv import MixedKVCache
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from tests.model.test_dsa import TOPK, build_dsa
from tests.model.test_mla import build_mla

PAGE = 4
SETTINGS = {"model": {}, "fp8": {"kv_cache_dtype": "fp8_e4m3"},
            "mixed": {"kv_cache_dtype": "fp8_e4m3", "kv_history_dtype": "auto"}}


def engine(folder, setting: str, **kw) -> Engine:
    config = EngineConfig(model_path=str(folder), page_size=PAGE, max_total_tokens=kw.pop("max_total_tokens", 1024),
                          chunked_prefill_size=kw.pop("chunked_prefill_size", 64), **SETTINGS[setting], **kw)
    return Engine(config, ModelRunner.from_config(config), frozenset())


def run(eng: Engine, prompts: dict[str, list[int]], **params) -> dict[str, list]:
    """Every prompt at once, greedy; per request: its outputs' (token ids, logprobs, prompt logprobs, cached)."""
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True, **params))
    out = {rid: [[], [], None, 0] for rid in prompts}
    while eng.has_unfinished():
        for item in eng.step():
            entry = out[item.request_id]
            entry[0] += item.new_token_ids
            entry[1] += [(lp.token_id, lp.logprob, lp.top) for lp in item.new_logprobs or ()]
            entry[2] = entry[2] or item.prompt_logprobs
            entry[3] = max(entry[3], item.num_cached_tokens)
    return out


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    return build_mla(tmp_path_factory.mktemp("mla"))


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory):
    return build_dsa(tmp_path_factory.mktemp("dsa"))


@pytest.mark.parametrize("latent", [False, True])
def test_reads_dequantise_fp8_pages_through_the_same_accessor(latent):
    """Global pages 0-2 are model-dtype pages 0-2, 3-4 FP8 pages 0-1: a read over both equals each store's own."""
    torch.manual_seed(0)
    heads = 1 if latent else 2
    scale = torch.full((1, heads), 0.02)
    mixed = MixedKVCache.build(1, 3, 2, PAGE, heads, 8, torch.float8_e4m3fn, torch.device("cpu"), torch.float32,
                               scale, scale, latent)
    ref_model = KVCache(1, 3, PAGE, heads, 8, torch.float32, latent=latent)
    ref_fp8 = KVCache(1, 2, PAGE, heads, 8, torch.float8_e4m3fn, compute_dtype=torch.float32, k_scale=scale,
                      v_scale=scale, latent=latent)
    k, v = torch.randn(20, heads, 8), torch.randn(20, heads, 8)
    mixed.write(0, torch.arange(20), k, v)
    ref_model.write(0, torch.arange(12), k[:12], v[:12])
    ref_fp8.write(0, torch.arange(8), k[12:], v[12:])
    got_k, got_v = mixed.read_pages(0, torch.tensor([4, 0, 3, 2]))
    want = [torch.cat(parts, dim=1) for parts in zip(ref_fp8.read_pages(0, torch.tensor([1])),
                                                      ref_model.read_pages(0, torch.tensor([0])),
                                                      ref_fp8.read_pages(0, torch.tensor([0])),
                                                      ref_model.read_pages(0, torch.tensor([2])))]
    assert torch.equal(got_k, want[0]) and torch.equal(got_v, want[1])
    assert not torch.equal(got_k[:, :PAGE], k[16:].transpose(0, 1)), "FP8 pages must be lossy here"


@pytest.fixture(scope="module")
def engines(gqa_dir):
    return {name: engine(gqa_dir, name) for name in SETTINGS}


def test_prompt_logprobs_equal_the_model_dtype_server(engines):
    """(a) Chunked prefills (chunks of 64 over 150 tokens) read history at the model dtype: bit-equal."""
    prompts = {"a": prompt_of(150, 1), "b": prompt_of(37, 2)}
    ref = run(engines["model"], prompts, max_tokens=2, prompt_logprobs=3, logprobs=3)
    got = run(engines["mixed"], prompts, max_tokens=2, prompt_logprobs=3, logprobs=3)
    fp8 = run(engines["fp8"], prompts, max_tokens=2, prompt_logprobs=3, logprobs=3)
    for rid in prompts:
        assert got[rid][2] == ref[rid][2] and got[rid][1][0] == ref[rid][1][0]
        assert fp8[rid][2] != ref[rid][2], "all-FP8 KV must differ, or this test cannot fail"


def test_decode_pages_are_fp8_and_pool_bytes_equal_the_formula(engines):
    """(b) The pages a decode adds hold FP8 bytes that are written (nonzero); history pages hold fp32."""
    eng = engines["mixed"]
    kv, pool = eng.runner.kv, eng.kv.pool
    assert kv.allocated_bytes() == sum(n * b for n, b in zip((pool.num_model_pages, pool.num_fp8_pages),
                                                              kv.bytes_per_page()))
    prompt = prompt_of(12, 3)
    eng.add_request("d", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))
    req = eng.requests["d"]
    while len(req.output_ids) < 10:
        eng.step()
    history, decoded = req.page_ids[:3], req.page_ids[3:]
    assert len(decoded) >= 2 and all(p >= pool.num_model_pages for p in decoded)
    for dtype, k in kv.stored_pages(decoded):
        assert dtype == torch.float8_e4m3fn and k.element_size() == 1 and k.float().abs().sum() > 0
    assert all(dtype == torch.float32 for dtype, _ in kv.stored_pages(history))
    eng.abort("d")


def test_decode_mirror_reads_what_the_pages_hold(gqa_dir, engines):
    """The DecodeMirror rounds each new token through its page's dtype: decoding with it gives what decoding with
    per-step page gathers gives (the mirror's new tokens in FP8 pages would otherwise stay exact)."""
    from radixserve.runner.attention.torch_backend import TorchAttentionBackend
    assert engines["mixed"].runner.backend.mirror is not None
    gathers = engine(gqa_dir, "mixed")
    gathers.runner.backend = TorchAttentionBackend(gathers.runner.kv, mirror_bytes=0)
    prompts = {f"m{i}": prompt_of(13 + 9 * i, 20 + i) for i in range(3)}
    want = run(gathers, prompts, max_tokens=24, logprobs=3)
    got = run(engines["mixed"], prompts, max_tokens=24, logprobs=3)
    for rid in prompts:
        assert got[rid][0] == want[rid][0]
        assert max(abs(a[1] - b[1]) for a, b in zip(got[rid][1], want[rid][1])) < 1e-5


def test_memory_sized_pool_splits_bytes_by_the_fraction(gqa_dir):
    config = EngineConfig(model_path=str(gqa_dir), page_size=PAGE, kv_cache_memory_gb=0.001,
                          kv_fp8_page_fraction=0.5, **SETTINGS["mixed"])
    runner = ModelRunner.from_config(config)
    model_bytes, fp8_bytes = runner.kv.bytes_per_page()       # 2 layers x 2 heads x 16 x 2 (K, V) x PAGE x 4 / 1
    assert (model_bytes, fp8_bytes) == (2 * 2 * 16 * 2 * PAGE * 4, 2 * 2 * 16 * 2 * PAGE)
    budget = int(0.001 * 2**30)
    assert runner.num_fp8_pages == (budget // 2) // fp8_bytes
    assert runner.num_pages - runner.num_fp8_pages == (budget - budget // 2) // model_bytes
    assert runner.kv.allocated_bytes() <= budget


@pytest.mark.parametrize("family", ["gqa_dir", "mla_dir", "dsa_dir"])
def test_second_turn_hits_only_history_and_equals_the_reference(family, request):
    """(c) Turn 2 = turn 1's prompt + its reply + new text. With mixed pages the radix hit is turn 1's prompt only
    (the reply re-prefills at the model dtype) and turn 2's first-token logprobs equal the reference server's,
    which has cached the same prompt pages, and the mixed server's own for turn 2 sent whole (within 1e-5: other
    chunking); all-FP8 KV hits the reply too and differs. GQA, MLA's latent, and DSA (glm_moe_dsa: index keys in one
    side buffer over both ranges; turn 2 is longer than index_topk, so its attention is sparse)."""
    folder = request.getfixturevalue(family)
    turn1 = prompt_of(24, 4)                                   # page-aligned: the reply starts an FP8 page
    mixed = engine(folder, "mixed")
    reply = run(mixed, {"t1": turn1}, max_tokens=9)["t1"][0]
    tree = mixed.kv.cache.all_page_ids()
    assert tree and all(p < mixed.kv.pool.num_model_pages for p in tree), "the tree holds an FP8 page"
    turn2 = turn1 + reply + prompt_of(11, 5)
    assert family != "dsa_dir" or len(turn2) > TOPK
    got = run(mixed, {"t2": turn2}, max_tokens=1, logprobs=5)["t2"]
    assert got[3] == len(turn1)
    ref = engine(folder, "model")
    run(ref, {"t1": turn1}, max_tokens=1)                     # caches the prompt pages only, as above
    want = run(ref, {"t2": turn2}, max_tokens=1, logprobs=5)["t2"]
    assert want[3] == len(turn1) and got[1] == want[1]
    whole = run(engine(folder, "mixed"), {"t2": turn2}, max_tokens=1, logprobs=5)["t2"]    # C39 (c): sent whole
    assert whole[3] == 0 and whole[0] == got[0] and abs(whole[1][0][1] - got[1][0][1]) < 1e-5
    fp8 = engine(folder, "fp8")
    run(fp8, {"t1": turn1}, max_tokens=9)
    drift = run(fp8, {"t2": turn2}, max_tokens=1, logprobs=5)["t2"]
    assert drift[3] > len(turn1) and drift[1] != want[1]


def test_no_page_leaks_after_preemption_and_aborts(gqa_dir):
    """(d) A pool of 40 pages (10 FP8) for 6 requests of 30 + 20 tokens forces preemptions; two are aborted
    mid-decode. Afterwards every page is free or in the tree, the tree holds no FP8 page, and a flush frees all."""
    eng = engine(gqa_dir, "mixed", max_total_tokens=40 * PAGE, chunked_prefill_size=32)
    assert (eng.kv.pool.num_model_pages, eng.kv.pool.num_fp8_pages) == (30, 10)
    for i in range(6):
        eng.add_request(f"r{i}", prompt_of(30, 10 + i), SamplingParams(temperature=0.0, ignore_eos=True,
                                                                       max_tokens=20))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
        steps += 1
        if steps == 12:
            eng.abort("r1")
            eng.abort("r4")
    assert eng.scheduler.num_preemptions > 0
    pool = eng.kv.pool
    assert all(p < pool.num_model_pages for p in eng.kv.cache.all_page_ids())
    stats = eng.stats()
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"] == 40
    assert stats["num_free_fp8_pages"] == stats["num_fp8_pages"] == 10
    assert eng.flush_cache() and pool.num_free == pool.num_pages


@pytest.mark.parametrize("flags, message", [
    ({"kv_history_dtype": "auto"}, "needs --kv-cache-dtype fp8"),
    ({**SETTINGS["mixed"], "kv_fp8_page_fraction": 0.0}, "must be in (0, 1)"),
    ({"kv_fp8_page_fraction": float("nan")}, "must be in (0, 1)"),          # checked without the policy too
    ({**SETTINGS["mixed"], "max_total_tokens": 32, "page_size": 16, "kv_fp8_page_fraction": 0.99},
     "splits into 0 history and 2 fp8 pages"),
    ({**SETTINGS["mixed"], "speculative_algorithm": "ngram"}, "--speculative-algorithm ngram"),
    ({**SETTINGS["mixed"], "enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({**SETTINGS["mixed"], "disaggregation_mode": "decode"}, "--disaggregation-mode"),
    ({**SETTINGS["mixed"], "attention_backend": "triton"}, "--attention-backend triton"),
    ({**SETTINGS["mixed"], "compile": "on"}, "--compile on"),
    ({**SETTINGS["mixed"], "enable_deterministic_inference": True}, "--enable-deterministic-inference"),
])
def test_bad_flag_combinations_are_refused(flags, message):
    """(e)"""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**flags)


def test_too_small_a_pool_is_refused(gqa_dir):
    """With --max-total-tokens the split is known from the flags: refused by EngineConfig, before any load; a
    memory-sized pool is split (and refused) by the runner."""
    with pytest.raises(ValueError, match="0 fp8"):
        EngineConfig(model_path=str(gqa_dir), page_size=PAGE, max_total_tokens=3 * PAGE,
                     kv_fp8_page_fraction=0.1, **SETTINGS["mixed"])
    config = EngineConfig(model_path=str(gqa_dir), page_size=PAGE, kv_cache_memory_gb=1e-6, **SETTINGS["mixed"])
    with pytest.raises(ValueError, match="history and 0 fp8 pages|needs at least 2 and 1"):
        ModelRunner.from_config(config)


def test_serve_exits_2_naming_the_flags(capsys):
    """(e) at the command line: `radixserve serve` refuses before loading anything."""
    from radixserve.cli import main
    assert main(["serve", "--kv-cache-dtype", "fp8_e4m3", "--kv-history-dtype", "auto",
                 "--enable-hierarchical-cache"]) == 2
    assert "--kv-history-dtype auto cannot be combined with --enable-hierarchical-cache" in capsys.readouterr().err


def test_dsa_pool_bytes_count_index_keys_over_every_page(dsa_dir):
    """glm_moe_dsa under the policy: K/V split by range, index keys one side buffer over all pages (model dtype),
    and the pool's bytes are exactly that."""
    from radixserve.runner.attention.sparse import INDEX_KEYS
    eng = engine(dsa_dir, "mixed")
    kv, pool, mc = eng.runner.kv, eng.kv.pool, eng.runner.model_config
    assert INDEX_KEYS in kv.side_names and kv.side_layers(INDEX_KEYS) == list(mc.dsa.full_layers)
    index = len(mc.dsa.full_layers) * mc.dsa.index_head_dim * 4              # fp32 index keys per token
    pages = zip((pool.num_model_pages, pool.num_fp8_pages), kv.bytes_per_page())
    assert kv.allocated_bytes() == sum(n * b for n, b in pages) + pool.num_pages * PAGE * index
