"""EAGLE / NextN speculation with glm4_moe's MTP layer (issue 41 items 1-2; cases C51-C53).

A tiny random glm4_moe with one MTP layer in GLM's on-disk layout (tests/model/mtp_checkpoint.py). Every draft
the engine proposes equals transformers' own MTP chain (its Glm4MoeDecoderLayer block, norms and eh_proj, in
MtpModel.forward_layer) over the same tokens, with chunked prefill, radix hits, preemption and the host tier
(the draft's KV is a layer of the target's cache: C51); greedy and seeded output equal the output without
speculation; a draft built to be exact is accepted (accept length > 1); under PD the decode side drafts from
the draft KV the prefill side sent (C52); missing or mismatched MTP weights fail the load (C53); tree drafts,
FP8 KV and the disk tier are refused."""
from __future__ import annotations

import pytest

from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from tests.model.mtp_checkpoint import build_glm_mtp, hf_mtp_drafts
from tests.model.parity import engine_generate
from tests.model.test_hicache_model import SMALL_POOL, sessions
from tests.model.test_parity import SCENARIOS, make_engine, prompt_set

EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 4}
NUM_NEW = 24
LENGTHS = [1, 7, 16, 23, 40, 65, 100]
TIGHT = {"max_total_tokens": 256}   # e_preemption for these shorter prompts: 16 pages


def scenario_cfg(name: str) -> dict:
    return {**SCENARIOS[name]["cfg"], **(TIGHT if name == "e_preemption" else {})}


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm_mtp")
    model, mtp = build_glm_mtp(folder)
    return folder, model, mtp


@pytest.fixture(scope="module")
def exact_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm_mtp_exact")
    build_glm_mtp(folder, exact=True)
    return folder


def record_drafts(engine) -> list[tuple[list[int], list[int], list]]:
    """(tokens through the one just sampled, the drafts proposed after it, each draft's logits (V,)) for
    every draft the engine makes."""
    mtp, records = engine.runner.mtp, []
    extend, logits_of, calls = mtp.extend, mtp.layer.logits, []

    def logits(hidden):
        out = logits_of(hidden)
        calls.append(out)
        return out

    def recording(batch, step, hidden, results):
        calls.clear()
        drafts = extend(batch, step, hidden, results)
        rows = [iter(c) for c in calls]   # chain step j: a row per sequence still drafting, in batch order
        mine = [[] for _ in drafts]
        for j, it in enumerate(rows):
            for i, draft in enumerate(drafts):
                if len(draft) > j:
                    mine[i].append(next(it))
        for seq, res, draft, lg in zip(batch, results, drafts, mine):
            if draft:
                tokens = [*seq.prompt_ids, *seq.output_ids, *res.token_ids]
                records.append((tokens, list(draft), lg))
        return drafts
    mtp.extend = recording
    mtp.layer.logits = logits
    return records


def assert_drafts_match_transformers(model, mtp, records, limit: int = 60):
    """Each chain equals transformers': logits within 1e-5 (fp32 rounding gives ~2e-7 here; one stale draft
    KV position ~3e-4), a differing draft only at a tie (top-2 gap < 1e-4), the chain after it unchecked."""
    assert records, "no drafts were proposed"
    step = max(1, len(records) // limit)
    for tokens, draft, logits in records[::step]:
        ref, gaps, ref_logits = hf_mtp_drafts(model, mtp, tokens, len(draft))
        for j, (ours, theirs) in enumerate(zip(draft, ref)):
            diff = float((logits[j] - ref_logits[j]).abs().max())
            assert diff < 1e-5, f"after {len(tokens)} tokens, draft {j}: logits differ by {diff}"
            if ours != theirs:
                assert gaps[j] < 1e-4, f"after {len(tokens)} tokens: draft {draft} vs transformers {ref}"
                break


@pytest.mark.parametrize("name", ["b_all_at_once", "c_warm_cache", "d_small_chunks", "e_preemption"])
def test_drafts_equal_transformers_mtp(mtp_case, name):
    check_drafts_in_scenario(mtp_case, name)


def check_drafts_in_scenario(case, name: str):
    """Scenario `name` with EAGLE over case = (folder, hf model, hf MtpModel): every draft equals transformers'.
    Returns the engine."""
    folder, model, mtp = case
    spec = SCENARIOS[name]
    prompts = prompt_set(256, 1, LENGTHS)
    engine = make_engine(folder, **scenario_cfg(name), **EAGLE)
    if spec.get("warm"):
        engine_generate(engine, prompts, 1)
    records = record_drafts(engine)
    engine_generate(engine, prompts, NUM_NEW, at_once=spec["at_once"])
    assert_drafts_match_transformers(model, mtp, records)
    if name == "e_preemption":
        assert engine.stats()["num_preemptions"] > 0
    return engine


@pytest.mark.parametrize("page_size", [1, 16])
def test_drafts_equal_transformers_mtp_after_a_shared_prefix(mtp_case, page_size):
    """C51: a 3-page shared prefix, then new suffixes. The draft KV of the prefix's last position was computed
    from the token after it, so pages are keyed by token pairs (engine/kv_manager.py paired_key): a hit never
    reuses draft KV made for another next token."""
    check_drafts_after_a_shared_prefix(mtp_case, page_size)


def check_drafts_after_a_shared_prefix(case, page_size: int) -> None:
    folder, model, mtp = case
    prefix = prompt_set(256, 4, [48])[0]
    prompts = [prefix + s for s in prompt_set(256, 5, [0, 9, 20, 33])]
    prompts.append(list(prompts[1]))   # the same prompt again: a full hit
    engine = make_engine(folder, page_size=page_size, chunked_prefill_size=64, **EAGLE)
    records = record_drafts(engine)
    _, cached = engine_generate(engine, prompts, 12, at_once=False)
    assert all(c >= 48 - page_size - 1 for c in cached[1:4]), cached        # the prefix, less a page at most
    assert cached[4] >= len(prompts[4]) - page_size - 2, cached            # C51's bound for a full hit
    assert_drafts_match_transformers(model, mtp, records)


def test_drafts_equal_transformers_mtp_after_host_tier_reloads(mtp_case):
    """C51: the draft's KV travels to the host tier and back with the target's (one cache, one more layer)."""
    check_drafts_after_host_tier_reloads(mtp_case)


def check_drafts_after_host_tier_reloads(case) -> None:
    folder, model, mtp = case
    prompts = [[t % 250 + 3 for t in p] for p in sessions(n=4, length=110)]
    engine = make_engine(folder, enable_hierarchical_cache=True, **SMALL_POOL, **EAGLE)
    engine_generate(engine, prompts, 8)
    records = record_drafts(engine)
    for _ in range(2):
        engine_generate(engine, prompts, 8)
    stats = engine.stats()
    assert stats["hicache_loads"] > 0 and stats["num_cached_tokens_host"] > 0
    assert_drafts_match_transformers(model, mtp, records)


def test_pd_decode_drafts_from_the_transferred_draft_kv(mtp_case):
    """C52: the prefill side computes the draft's KV through the last prompt position (it samples the token
    after it) and sends it with the target's, as one more layer of each page; the decode side's first step
    decodes without a draft, which gives it the hidden state to draft from. Output equals colocated, and
    every decode-side draft equals transformers' (a draft layer left behind would not)."""
    check_pd_decode_drafts(mtp_case)


def check_pd_decode_drafts(case) -> None:
    from tests.model.test_pd_race import pd
    from tests.unit.pd_helpers import Rig, greedy

    folder, model, mtp = case
    prompts = prompt_set(256, 6, [1, 5, 13, 30, 47, 100, 150])   # the last two: prefill chunks of 64
    want, _ = engine_generate(make_engine(folder, page_size=4), prompts, 10)
    p, d = pd("prefill", folder, 4096, **EAGLE), pd("decode", folder, 4096, **EAGLE)
    records = record_drafts(d.engine)
    rig = Rig(p, d)
    try:
        for i, prompt in enumerate(prompts):
            rig.submit(p, d, f"r{i}", prompt, greedy(10), room=200 + i)
        rig.finish(*(f"r{i}" for i in range(len(prompts))))
        assert [rig.tokens[f"r{i}"] for i in range(len(prompts))] == want
    finally:
        rig.close()
    assert d.engine.stats()["spec_num_verify_steps"] > 0
    assert_drafts_match_transformers(model, mtp, records)


def generate(engine, prompts, params) -> tuple[list[list[int]], list]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens, spec = {i: [] for i in range(len(prompts))}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.new_token_ids
            if out.finished:
                spec[int(out.request_id[1:])] = out.spec
        engine.check_invariants()
    return [tokens[i] for i in range(len(prompts))], [spec.get(i) for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("exact", [False, True], ids=["random", "exact"])
def test_greedy_equals_no_speculation(mtp_case, exact_dir, name, exact):
    check_greedy_equals_no_speculation(exact_dir if exact else mtp_case[0], name, exact)


def check_greedy_equals_no_speculation(folder, name: str, exact: bool = False) -> None:
    """Scenario `name` over `folder`: greedy tokens with EAGLE equal those without; `exact`: drafts are accepted."""
    spec = SCENARIOS[name]
    prompts = prompt_set(256, 2, LENGTHS)
    if not spec["at_once"]:   # one request per step: every other prompt (1 to 100 tokens) covers its path
        prompts = prompts[::2]
    outs = []
    for algorithm in ({}, EAGLE):
        engine = make_engine(folder, **scenario_cfg(name), **algorithm)
        if spec.get("warm"):
            engine_generate(engine, prompts, 1)
        outs.append(engine_generate(engine, prompts, NUM_NEW, at_once=spec["at_once"])[0])
    assert outs[0] == outs[1]
    s = engine.stats()
    assert s["spec_num_verify_steps"] > 0
    if exact:   # the exact draft is accepted: more than one token per verify step
        assert s["spec_num_accepted_tokens"] > s["spec_num_verify_steps"]
    if name == "e_preemption":
        assert s["num_preemptions"] > 0


def test_seeded_sampling_equals_no_speculation_and_exact_drafts_are_accepted(exact_dir, mtp_case):
    prompts = prompt_set(256, 3, [5, 30, 64])
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    for folder in (exact_dir, mtp_case[0]):
        plain, _ = generate(make_engine(folder), prompts, params)
        spec_out, counts = generate(make_engine(folder, **EAGLE), prompts, params)
        assert spec_out == plain
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    _, counts = generate(make_engine(exact_dir, **EAGLE), prompts, greedy)
    for c in counts:   # SGLang's accept length: tokens per verify step, the bonus token counted
        assert c.verify_steps > 0 and c.accept_length == (c.accepted_tokens + c.verify_steps) / c.verify_steps
        assert c.accept_length > 2.5


def runner(folder, **cfg):
    return ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512, **{**EAGLE, **cfg}))


def rewrite(folder, edit):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case, error", [
    ("no_layer", "no NextN"),
    ("no_eh_proj", r"lacks model\.layers\.3\.eh_proj\.weight"),
    ("no_expert", r"experts:5\.up_proj"),
    ("unknown", r"model\.layers\.3\.\*: checkpoint tensor extra\.weight matches no model parameter"),
    ("bad_shape", r"shape mismatch for hnorm\.weight"),
    ("bad_head", r"shape mismatch for model\.layers\.3\.shared_head\.head\.weight"),
])
def test_missing_or_mismatched_mtp_weights_fail_the_load(tmp_path, case, error):
    """C53: never a draft left at its initial weights (silent zero acceptance)."""
    import torch

    build_glm_mtp(tmp_path)
    p = "model.layers.3."
    edits = {
        "no_layer": lambda t: [t.pop(k) for k in [k for k in t if k.startswith(p)]],
        "no_eh_proj": lambda t: t.pop(p + "eh_proj.weight"),
        "no_expert": lambda t: t.pop(p + "mlp.experts.5.up_proj.weight"),
        "unknown": lambda t: t.__setitem__(p + "extra.weight", torch.zeros(3)),
        "bad_shape": lambda t: t.__setitem__(p + "hnorm.weight", torch.ones(32)),
        "bad_head": lambda t: t.__setitem__(p + "shared_head.head.weight", torch.zeros(10, 64)),
    }
    rewrite(tmp_path, edits[case])
    with pytest.raises(ValueError, match=error):
        runner(tmp_path)


def test_the_layers_own_copies_are_shared_or_kept_and_reported(tmp_path, mtp_case):
    import torch

    build_glm_mtp(tmp_path, shared_copies=True)
    info = runner(tmp_path).info()["nextn_draft"]
    assert "equal to the target's, shared" in info["embed"] and "equal to the target's, shared" in info["head"]
    assert info["layer"].startswith("model.layers.3.*")
    rewrite(tmp_path, lambda t: t.__setitem__("model.layers.3.shared_head.head.weight",
                                              torch.randn_like(t["model.layers.3.shared_head.head.weight"])))
    assert "its own" in runner(tmp_path).info()["nextn_draft"]["head"]
    assert "the target's lm_head" in runner(mtp_case[0]).info()["nextn_draft"]["head"]


def test_a_family_without_a_nextn_layer_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="'llama' has none"):
        runner(tiny_llama_dir)


@pytest.mark.parametrize("cfg, error", [
    ({"speculative_eagle_topk": 2}, "only 1 is supported"),
    ({"speculative_draft_min_prob": 1.0}, "must be in \\[0, 1\\)"),
    ({"speculative_num_draft_tokens": 3}, "must be --speculative-num-steps \\+ 1 = 4"),
    ({"hicache_storage_dir": "/tmp/x", "enable_hierarchical_cache": True},
     "cannot be combined with --hicache-storage-dir"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "cannot be combined with --kv-cache-dtype fp8"),
])
def test_unsupported_eagle_settings_are_refused(cfg, error):
    """Tree drafts (topk > 1), FP8 KV and the disk tier (it hashes token keys) are refused."""
    with pytest.raises(ValueError, match=error):
        EngineConfig(model_path="x", **{**EAGLE, **cfg})


def test_nextn_is_an_alias_and_eagle_flags_need_eagle():
    c = EngineConfig(model_path="x", speculative_algorithm="NEXTN", speculative_num_steps=5)
    assert c.is_eagle and c.spec_max_draft == 5
    assert EngineConfig(model_path="x", speculative_algorithm="EAGLE").spec_max_draft == 3
    with pytest.raises(ValueError, match="needs? --speculative-algorithm EAGLE"):
        EngineConfig(model_path="x", speculative_algorithm="ngram", speculative_num_steps=2)
    with pytest.raises(ValueError, match="needs? --speculative-algorithm EAGLE"):
        EngineConfig(model_path="x", speculative_algorithm="ngram", speculative_draft_min_prob=0.5)


def test_kv_corrupt_fault_changes_the_target_layers_only(mtp_case):
    """The draft's KV is written by the draft alone (the detector compares it with a corrupted target's)."""
    import torch

    r = runner(mtp_case[0])
    for store in (*r.kv._k, *r.kv._v):
        store.copy_(torch.randn_like(store))
    before = r.kv.export_pages([3])
    r.corrupt_kv([3], "noise", None, seed=1)
    after = r.kv.export_pages([3])
    assert not torch.equal(before.k[:-1], after.k[:-1]) and not torch.equal(before.v[:-1], after.v[:-1])
    assert torch.equal(before.k[-1], after.k[-1]) and torch.equal(before.v[-1], after.v[-1])
