"""GLM-5's DSA (glm_moe_dsa, models/dsa.py) against transformers: every position's logits, the indexer's top-k sets
per (layer, position) under chunking (C48), IndexShare layers (C50), the dense/sparse boundary (C49), the pool's bytes
per token against docs/mla.md's formula, and the refusals. The five scheduling scenarios run in test_families.py."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.models.dsa import DSAAttention
from radixserve.models.model_config import ModelConfig
from radixserve.runner.attention.base import create_backend
from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.runner.kv_sizing import num_pages
from radixserve.runner.model_runner import ModelRunner
from tests.model.test_families import COMMON, FAMILIES, build_family
from tests.model.test_mla import forward_logits
from tests.model.test_runner import Seq

BASE = FAMILIES["glm_moe_dsa"][2]
TOPK = BASE["index_topk"]
# name -> config kwargs over BASE; glm-archs §3.5: freq 4 -> F F S S S F, freq 4 offset 1 -> F S S S F S.
VARIANTS = {"all_full": {}, "share_freq_4": {"num_hidden_layers": 6, "index_topk_freq": 4},
            "share_freq_4_offset_1": {"num_hidden_layers": 6, "index_topk_freq": 4, "index_skip_topk_offset": 1},
            "share_pattern": {"num_hidden_layers": 4, "index_topk_pattern": "FSFS"}}
ATOL = 1e-4


def build_dsa(folder, seed: int = 1, **extra):
    spec = ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**BASE, "vocab_size": 512, **extra})
    return build_family(folder, "glm_moe_dsa", seed=seed, spec=spec)


def make_runner(folder, **cfg) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=16, max_total_tokens=1024, **cfg))


def run_chunks(runner: ModelRunner, tokens: list[int], chunks: list[int], decodes: int = 0) -> tuple[Seq, torch.Tensor]:
    """Prefill `tokens` in `chunks`, then greedy `decodes`; the sequence and every row's logits."""
    seq = Seq("a", list(tokens), list(range(runner.num_pages))[::-1])
    out = [forward_logits(runner, seq, n) for n in chunks]
    for _ in range(decodes):
        seq.output.append(int(out[-1][-1].argmax()))
        out.append(forward_logits(runner, seq, 1))
    return seq, torch.cat(out)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.inference_mode()
def test_logits_equal_transformers_at_every_position(tmp_path, variant):
    """Chunks that straddle index_topk, then decodes: every logit row within 1e-4 of transformers' one forward;
    shared layers build no indexer, so a checkpoint without their indexer weights loads."""
    from transformers import AutoModelForCausalLM

    folder = build_dsa(tmp_path, **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = make_runner(folder)
    full = tuple(i for i, t in enumerate(hf.config.indexer_types) if t == "full")
    assert runner.model_config.dsa.full_layers == full
    assert [m.indexer is not None for m in runner.model.modules() if isinstance(m, DSAAttention)] == \
        [i in full for i in range(hf.config.num_hidden_layers)]
    seq, ours = run_chunks(runner, prompt(70), [5, 30, 12, 23], decodes=6)
    ref = hf(torch.tensor([seq.tokens])).logits[0, :seq.computed]
    assert float((ours - ref).abs().max()) <= ATOL


def record(modules, kinds, out: dict):
    """Forward hooks that append each `kinds` module's selection to out[layer] (for ours: the step's shared_selection,
    read after the layer ran; for transformers' attention: its top-k output)."""
    hooks = []
    for name, module in modules:
        if isinstance(module, kinds):
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(mod, args, output, layer=layer):
                out.setdefault(layer, []).append(args[4].shared_selection if isinstance(mod, DSAAttention)
                                                 else output[2][0])
            hooks.append(module.register_forward_hook(hook))
    return hooks


@pytest.mark.parametrize("variant", ["all_full", "share_freq_4"])
@torch.inference_mode()
def test_topk_sets_equal_transformers_under_chunking(tmp_path, variant):
    """C48/C50: per (layer, position) the set of positions our indexer picks (chunked prefill and decodes) is the set
    transformers picks in one forward; a shared layer uses exactly the last full layer's selection; prompts shorter
    than index_topk select nothing (the dense step, every causal position)."""
    from transformers import AutoModelForCausalLM

    folder = build_dsa(tmp_path, **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_attn = type(hf.model.layers[0].self_attn)
    runner = make_runner(folder)
    for length, chunks in [(3, [3]), (TOPK, [TOPK]), (TOPK + 1, [TOPK + 1]), (17, [9, 8]), (64, [13, 20, 31]),
                           (150, [150])]:
        ours: dict[int, list] = {}
        hooks = record(runner.model.named_modules(), DSAAttention, ours)
        seq, _ = run_chunks(runner, prompt(length, seed=length), chunks, decodes=3)
        for h in hooks:
            h.remove()
        theirs: dict[int, list] = {}
        hooks = record(hf.named_modules(), hf_attn, theirs)
        hf(torch.tensor([seq.tokens[:seq.computed]]))
        for h in hooks:
            h.remove()
        sizes = chunks + [1, 1, 1]
        for layer, steps in ours.items():
            ref = theirs[layer][0]                                                   # (positions, K)
            start = 0
            for size, selection in zip(sizes, steps):
                if selection is None:
                    assert start + size <= TOPK, "a dense step past index_topk"
                else:
                    for row, chosen in enumerate(selection[0].tolist()):
                        pos = start + row
                        expect = {p for p in ref[pos].tolist() if p <= pos}
                        assert {p for p in chosen if p >= 0} == expect, (layer, pos)
                        assert len(expect) == min(TOPK, pos + 1)
                start += size
            full = runner.model_config.dsa.full_layers
            if layer not in full:
                last = max(f for f in full if f < layer)
                assert all(a is b for a, b in zip(steps, ours[last])), "a shared layer chose on its own"


def lite_twin(folder, out):
    """The same checkpoint as glm4_moe_lite: DSA's weights without the indexer (glm-archs §0.3)."""
    import transformers

    dsa = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    extra = {k: v for k, v in BASE.items() if not k.startswith("index") and k != "first_k_dense_replace"}
    lite = transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(**{**COMMON, **extra,
                                                                               "vocab_size": 512}))
    state = {k: v for k, v in dsa.state_dict().items() if ".indexer." not in k}
    lite.load_state_dict(state, strict=True)
    lite.save_pretrained(out)
    return out


@torch.inference_mode()
def test_dense_side_of_the_boundary_is_plain_mla_bit_for_bit(tmp_path):
    """C49: while every context is <= index_topk the DSA model's logits equal the same weights as glm4_moe_lite exactly
    (fp32), index keys are still written for every token; past the boundary they differ (the indexer selects)."""
    folder = build_dsa(tmp_path / "dsa")
    dsa, lite = make_runner(folder), make_runner(lite_twin(folder, tmp_path / "lite"))
    lite.backend = create_backend("auto", lite.kv, lite.device, mirror=False)     # the kernels DSA's dense steps run
    tokens = prompt(3 * TOPK)
    _, ours = run_chunks(dsa, tokens, [TOPK - 2, 1, 1, 2 * TOPK])
    _, plain = run_chunks(lite, tokens, [TOPK - 2, 1, 1, 2 * TOPK])
    assert torch.equal(ours[:TOPK], plain[:TOPK])
    assert float((ours[TOPK + 1:] - plain[TOPK + 1:]).abs().max()) > 1e-3
    kv = dsa.kv
    slots = torch.tensor([p * kv.page_size + o for p in list(range(dsa.num_pages))[::-1][:1] for o in range(TOPK)])
    for layer in dsa.model_config.dsa.full_layers:
        assert bool((kv.read_side(INDEX_KEYS, layer, slots).abs().sum(-1) > 0).all()), layer


@pytest.mark.parametrize("dtype,width", [("float32", 4), ("bfloat16", 2)])
def test_pool_bytes_per_token_per_layer_are_latent_plus_index_key(tmp_path, dtype, width):
    """docs/mla.md: (kv_lora_rank + qk_rope_head_dim) x bytes in every layer + index_head_dim x bytes in full layers."""
    folder = build_dsa(tmp_path, **VARIANTS["share_freq_4"])
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), dtype=dtype, max_total_tokens=512,
                                                  page_size=16))
    mc, kv = runner.model_config, runner.kv
    latent, index = mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim, mc.dsa.index_head_dim
    assert mc.num_layers == 6 and len(mc.dsa.full_layers) == 3 and kv.side_layers(INDEX_KEYS) == [0, 1, 5]
    per_token = (mc.num_layers * latent + len(mc.dsa.full_layers) * index) * width
    assert kv.allocated_bytes() == kv.num_pages * kv.page_size * per_token
    assert kv.slot_bytes == per_token
    gib = EngineConfig(model_path=str(folder), dtype=dtype, kv_cache_memory_gb=0.001)
    assert num_pages(gib, mc) == int(0.001 * 2**30) // (per_token * gib.page_size)


def test_indexer_types_follow_transformers():
    """C50: indexer_types, else index_topk_pattern, else freq/offset, exactly as GlmMoeDsaConfig derives them."""
    from transformers import GlmMoeDsaConfig

    for extra in [{}, {"index_topk_freq": 4}, {"index_topk_freq": 4, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FSSF"}, {"indexer_types": ["full", "shared", "full", "shared"]}]:
        raw = {**COMMON, **BASE, "num_hidden_layers": 6 if "freq" in str(extra) else 4, "model_type": "glm_moe_dsa",
               **extra}
        types = GlmMoeDsaConfig(**raw).indexer_types
        assert ModelConfig.from_hf(raw).dsa.full_layers == tuple(i for i, t in enumerate(types) if t == "full")
    with pytest.raises(ValueError, match="layer 0 full"):
        ModelConfig.from_hf({**COMMON, **BASE, "model_type": "glm_moe_dsa", "index_topk_pattern": "SFF"})


def test_what_dsa_does_not_run_is_refused(tmp_path):
    """A full layer without its indexer weights and deterministic inference: load errors (a self-draft runs:
    test_dsa_speculative.py; EAGLE on the MTP layer: test_dsa_mtp.py). Under TP only the query heads must divide (C47: no KV-head divisibility check on the
    one latent head)."""
    from safetensors.torch import load_file, save_file

    from radixserve.models.llama import LlamaDecoderLayer

    mc = ModelConfig.from_hf({**COMMON, **BASE, "model_type": "glm_moe_dsa", "num_attention_heads": 12,
                              "num_key_value_heads": 6})     # 6 KV heads would not split 4 ways (GQA)
    assert LlamaDecoderLayer(mc, 1, tp=type("TP", (), {"size": 4, "rank": 1})()).self_attn.num_heads == 3
    with pytest.raises(ValueError, match="does not divide 12 attention heads"):
        LlamaDecoderLayer(mc, 1, tp=type("TP", (), {"size": 8, "rank": 0})())
    folder = build_dsa(tmp_path / "m")
    with pytest.raises(ValueError, match="glm_moe_dsa"):
        make_runner(folder, enable_deterministic_inference=True)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.indexer.wk.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="indexer.wk"):
        make_runner(folder)


@torch.inference_mode()
def test_mixed_batch_rows_equal_each_sequence_alone(tmp_path):
    """C49: one step holding a dense sequence (context <= index_topk) and sparse ones (a long chunk after a cached
    prefix, a decode) gives each sequence's logits as it gets alone; no sequence reads another's keys."""
    from radixserve.runner.batch import build_step

    folder = build_dsa(tmp_path)
    runner = make_runner(folder)
    pages = list(range(runner.num_pages))
    seqs = [Seq("short", prompt(TOPK - 3, seed=1), pages[0:4]), Seq("long", prompt(90, seed=2), pages[4:16]),
            Seq("decode", prompt(40, seed=3), pages[16:24])]
    done = {"short": 0, "long": 50, "decode": 39}
    for seq in seqs[1:]:
        forward_logits(runner, seq, done[seq.rid])
    step = build_step([s.chunk(None) for s in seqs], runner.page_size, runner.device)
    together = runner.model(step.input_ids, step.positions, runner.backend.prepare(step), None)
    alone = make_runner(folder)
    for seq, start, n in zip(seqs, step.query_starts, step.query_lens):
        fresh = Seq(seq.rid, seq.prompt, seq.pages)
        if done[seq.rid]:
            forward_logits(alone, fresh, done[seq.rid])
        ref = forward_logits(alone, fresh, n)
        assert float((together[start:start + n] - ref).abs().max()) <= 1e-5, seq.rid


@torch.inference_mode()
def test_fp8_index_keys_layout_bytes_and_drift(tmp_path):
    """--index-cache-dtype fp8_e4m3 (docs/mla.md): per full layer and token index_head_dim e4m3 bytes then the fp32
    scale amax / 448; the pool holds exactly that; chunked prefill reads what one prefill reads; the logits move off
    fp32 index keys only where a selection flips, and >= 85 % of the selected positions are the fp32 keys' choice."""
    from radixserve.runner.attention.sparse import decode_fp8, encode_fp8

    keys = torch.randn(6, 32) * torch.tensor([1e-3, 0.1, 1, 10, 100, 1e4])[:, None]
    raw = encode_fp8(keys)
    assert raw.dtype == torch.uint8 and raw.shape == (6, 36)
    assert torch.equal(raw[:, 32:].contiguous().view(torch.float32)[:, 0], keys.abs().amax(-1) / 448)
    assert bool(((decode_fp8(raw, torch.float32) - keys).abs() <= keys.abs().amax(-1, keepdim=True) / 16).all())
    folder = build_dsa(tmp_path, **VARIANTS["share_freq_4"])
    runner = make_runner(folder, index_cache_dtype="fp8_e4m3")
    mc, kv = runner.model_config, runner.kv
    per_token = (mc.num_layers * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim) * 4
                 + len(mc.dsa.full_layers) * (mc.dsa.index_head_dim + 4))
    assert kv.allocated_bytes() == kv.num_pages * kv.page_size * per_token == kv.slot_bytes * kv.num_pages * 16
    tokens = prompt(120, seed=9)
    _, chunked = run_chunks(runner, tokens, [30, 41, 49])
    chosen: dict[str, dict[int, list]] = {"fp8": {}, "exact": {}}
    runs = {}
    for name, cfg in [("fp8", {"index_cache_dtype": "fp8_e4m3"}), ("exact", {})]:
        other = make_runner(folder, **cfg)
        hooks = record(other.model.named_modules(), DSAAttention, chosen[name])
        runs[name] = run_chunks(other, tokens, [120])[1]
        for h in hooks:
            h.remove()
    whole, exact = runs["fp8"], runs["exact"]
    same = total = 0
    for layer in mc.dsa.full_layers:
        for a, b in zip(chosen["fp8"][layer][0][0].tolist(), chosen["exact"][layer][0][0].tolist()):
            same, total = same + len(set(a) & set(b)), total + len(b)
    assert same / total >= 0.85, same / total          # 0.88 measured on this random tiny model
    assert float((chunked - whole).abs().max()) <= 1e-5
    drift = (whole - exact).abs().amax(-1)
    # rows before index_topk attend to all they see whatever the keys (only the summation order may change)
    assert float(drift[:TOPK].max()) <= 1e-6 and float(drift.max()) > 1e-4, "the quantisation changed nothing"


@pytest.mark.parametrize("page_size", [1, 3, 64])
@torch.inference_mode()
def test_page_sizes_give_the_page_size_16_logits(tmp_path, page_size):
    """C46 for DSA: the context's slots come from the page table at any page size (prompt lengths P - 1 .. 3P + 1)."""
    folder = build_dsa(tmp_path)
    tokens = prompt(3 * page_size + 2 if page_size > 3 else 40, seed=page_size)
    _, ref = run_chunks(make_runner(folder), tokens, [len(tokens) - 5, 5], decodes=4)
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=page_size,
                                                  max_total_tokens=1024 // page_size * page_size))
    _, ours = run_chunks(runner, tokens, [len(tokens) - 5, 5], decodes=4)
    assert float((ours - ref).abs().max()) <= 1e-5



@torch.inference_mode()
def test_fp8_latent_kv_calibrates_and_reads_the_same_on_every_path(tmp_path):
    """--kv-cache-dtype fp8_e4m3 on a DSA model: scales calibrate (densely), chunks and decodes read what one prefill
    over the same tokens reads, and the latent quantisation is real."""
    folder = build_dsa(tmp_path)
    tokens = prompt(60, seed=11)
    runner = make_runner(folder, kv_cache_dtype="fp8_e4m3")
    seq, stepped = run_chunks(runner, tokens, [25, 35], decodes=4)
    _, whole = run_chunks(make_runner(folder, kv_cache_dtype="fp8_e4m3"), seq.tokens, [len(seq.tokens)])
    _, exact = run_chunks(make_runner(folder), seq.tokens, [len(seq.tokens)])
    assert float((stepped - whole).abs().max()) <= 1e-5
    assert float((whole - exact).abs().max()) > 1e-4
