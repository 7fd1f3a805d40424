"""A trained EAGLE draft head file for a Llama-family model (training/train_draft_head.py writes it; the default
model ships one: radixserve/weights/drafts/).

On a tiny random Llama with a head built by the training code itself (its DraftHead, exported by export_head, a
reduced draft vocabulary): every draft the engine proposes equals the training module's chain over the same tokens
(so what training optimises is what serving runs), only token-map ids are proposed, greedy output equals the output
without speculation; a bad head file is a load error (C53). The packaged head on the default model: taken by
--speculative-algorithm EAGLE, and its drafts are accepted."""
from __future__ import annotations

import os

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from radixserve.weights.default_draft import DEFAULT_DRAFT_HEAD, with_default_draft
from tests.model.parity import engine_generate
from tests.model.test_mtp import record_drafts
from tests.model.test_parity import SCENARIOS, make_engine, prompt_set
from training.train_draft_head import DraftHead, export_head

EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}
LENGTHS = [1, 9, 20, 47, 80]
MIN_PROB = 0.009     # the random head's top probabilities spread over 0.006-0.015


@pytest.fixture(scope="module")
def head_case(tiny_llama_dir, tmp_path_factory):
    """(folder, hf model, DraftHead, token_map, head file): the head perturbed from its initialisation so the
    embedding input matters; the token map every other vocabulary id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    torch.manual_seed(3)
    head = DraftHead(model).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if name.endswith("norm.weight") else 0.05))
    token_map = torch.arange(0, model.config.vocab_size, 2)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    export_head(head, token_map, model.config.num_hidden_layers, str(path), {}, dtype=torch.float32)
    return tiny_llama_dir, model, head, token_map, path


@torch.no_grad()
def training_chain(model, head: DraftHead, token_map, tokens: list[int], k: int):
    """The training module's k greedy drafts after `tokens` (the last just sampled), each with its reduced logits
    (K,) and top-2 gap: run over the whole sequence without a cache, as hf_mtp_drafts does for GLM's MTP."""
    ids = torch.tensor([tokens])
    hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state
    inputs = ids[:, 1:]
    rows = model.lm_head.weight[token_map]
    drafts, gaps, logits_out = [], [], []
    for _ in range(k):
        out = head(model.model.embed_tokens(inputs), hidden)
        logits = out[0, -1] @ rows.T
        top = logits.topk(2).values
        token = int(token_map[logits.argmax()])
        drafts.append(token)
        gaps.append(float(top[0] - top[1]))
        logits_out.append(logits)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        inputs = torch.cat([inputs, torch.tensor([[token]])], dim=1)
    return drafts, gaps, logits_out


@pytest.mark.parametrize("name", ["b_all_at_once", "d_small_chunks", "e_preemption"])
def test_drafts_equal_the_training_modules_chain(head_case, name):
    folder, model, head, token_map, path = head_case
    cfg = {**SCENARIOS[name]["cfg"], **({"max_total_tokens": 256} if name == "e_preemption" else {})}
    engine = make_engine(folder, **cfg, **EAGLE, speculative_draft_model_path=str(path))
    records = record_drafts(engine)
    engine_generate(engine, prompt_set(512, 1, LENGTHS), 20, at_once=SCENARIOS[name]["at_once"])
    assert records, "no drafts were proposed"
    allowed = set(token_map.tolist())
    for tokens, draft, logits in records[::max(1, len(records) // 40)]:
        assert set(draft) <= allowed
        ref, gaps, ref_logits = training_chain(model, head, token_map, tokens, len(draft))
        for j, (ours, theirs) in enumerate(zip(draft, ref)):
            diff = float((logits[j] - ref_logits[j]).abs().max())
            assert diff < 1e-4, f"after {len(tokens)} tokens, draft {j}: logits differ by {diff}"
            if ours != theirs:
                assert gaps[j] < 1e-3, f"after {len(tokens)} tokens: draft {draft} vs training {ref}"
                break


def test_greedy_output_equals_no_speculation(head_case):
    folder, _, _, _, path = head_case
    prompts = prompt_set(512, 2, LENGTHS)
    plain = engine_generate(make_engine(folder), prompts, 24)[0]
    engine = make_engine(folder, **EAGLE, speculative_draft_model_path=str(path))
    assert engine_generate(engine, prompts, 24)[0] == plain
    assert engine.stats()["spec_num_verify_steps"] > 0


def test_min_prob_ends_the_chain_before_an_unlikely_draft(head_case):
    """--speculative-draft-min-prob P: every proposed draft is the training chain's prefix of tokens with draft
    probability >= P, cut exactly before the first below P (some chains cut, some not); greedy output still equals no speculation."""
    folder, model, head, token_map, path = head_case
    prompts = prompt_set(512, 2, LENGTHS)
    plain = engine_generate(make_engine(folder), prompts, 24)[0]
    engine = make_engine(folder, **EAGLE, speculative_draft_model_path=str(path),
                         speculative_draft_min_prob=MIN_PROB)
    mtp, records = engine.runner.mtp, []
    extend = mtp.extend

    def recording(batch, step, hidden, results):
        drafts = extend(batch, step, hidden, results)
        records.extend(([*s.prompt_ids, *s.output_ids, *r.token_ids], d, s.propose)
                       for s, r, d in zip(batch, results, drafts) if r.token_ids and s.propose)
        return drafts
    mtp.extend = recording
    assert engine_generate(engine, prompts, 24)[0] == plain
    cut = 0
    for tokens, draft, wanted in records[::max(1, len(records) // 40)]:
        ref, gaps, logits = training_chain(model, head, token_map, tokens, wanted)
        probs = [float(torch.softmax(lg, -1).max()) for lg in logits]
        n = next((j for j, p in enumerate(probs) if p < MIN_PROB), wanted)
        if min(gaps[:n + 1]) > 1e-3 and min(abs(p - MIN_PROB) for p in probs[:n + 1]) > 1e-4:
            assert draft == ref[:n], f"after {len(tokens)} tokens: {draft} vs {ref} with probs {probs}"
            cut += n < wanted
    assert 0 < cut < len(records[::max(1, len(records) // 40)]), "the threshold never or always cut a chain"


def _runner(folder, path):
    return ModelRunner.from_config(EngineConfig(model_path=str(folder), max_total_tokens=512, **EAGLE,
                                                speculative_draft_model_path=str(path)))


@pytest.mark.parametrize("case, error", [
    ("not_safetensors", "not a readable safetensors file"),
    ("stray", r"tensors outside model\.layers\.2\.\*"),
    ("no_eh_proj", r"lacks model\.layers\.2\.eh_proj\.weight"),
    ("bad_shape", r"shape mismatch"),
    ("bad_map", r"token_map must hold distinct ids in \[0, 512\)"),
])
def test_a_bad_head_file_fails_the_load(head_case, tmp_path, case, error):
    """C53 for head files: never a draft at its initial weights or scoring rows that do not exist."""
    from safetensors.torch import load_file, save_file

    folder, _, _, _, path = head_case
    tensors = load_file(path)
    p = "model.layers.2."
    edits = {
        "stray": lambda t: t.__setitem__("model.layers.7.eh_proj.weight", t[p + "eh_proj.weight"].clone()),
        "no_eh_proj": lambda t: t.pop(p + "eh_proj.weight"),
        "bad_shape": lambda t: t.__setitem__(p + "hnorm.weight", torch.ones(32)),
        "bad_map": lambda t: t.__setitem__("token_map", torch.tensor([1, 2, 512])),
    }
    bad = tmp_path / "bad.safetensors"
    if case == "not_safetensors":
        bad.write_bytes(b"not a safetensors file")
    else:
        edits[case](tensors)
        save_file(tensors, bad)
    with pytest.raises(ValueError, match=error):
        _runner(folder, bad)


def test_eagle_on_the_default_model_takes_its_packaged_head(default_gguf, tiny_llama_dir):
    eagle = with_default_draft(EngineConfig(speculative_algorithm="EAGLE"))
    assert eagle.speculative_draft_model_path == DEFAULT_DRAFT_HEAD and os.path.exists(DEFAULT_DRAFT_HEAD)
    given = with_default_draft(EngineConfig(model_path=str(default_gguf), speculative_algorithm="EAGLE"))
    assert given.speculative_draft_model_path == DEFAULT_DRAFT_HEAD
    assert eagle.speculative_draft_min_prob == given.speculative_draft_min_prob == 0.4
    chosen = with_default_draft(EngineConfig(speculative_algorithm="EAGLE", speculative_draft_min_prob=0.0))
    assert chosen.speculative_draft_min_prob == 0.0
    assert with_default_draft(EngineConfig()).speculative_algorithm is None     # off by default
    assert with_default_draft(EngineConfig(speculative_algorithm="none")).speculative_algorithm is None
    assert with_default_draft(EngineConfig(speculative_algorithm="ngram")).speculative_algorithm == "ngram"
    other = with_default_draft(EngineConfig(model_path=str(tiny_llama_dir), speculative_algorithm="EAGLE"))
    assert other.speculative_draft_model_path is None and other.speculative_draft_min_prob is None


def test_the_shipped_head_is_accepted_on_the_default_model():
    """The packaged head drafts what the default model says (accept length > 1.3 on held-out prompts: 1.6
    measured in docs/speculative.md) and greedy output is the output without speculation."""
    from radixserve.llm import LLM
    from training.prompt_mix import prompts

    conversations = [[{"role": "user", "content": text}] for _, text in prompts(4, "heldout", seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    outs = {}
    for algorithm in ("EAGLE", None):
        llm = LLM(None, speculative_algorithm=algorithm)
        try:
            outs[algorithm] = llm.chat(conversations, params, use_tqdm=False)
        finally:
            llm.close()
    assert [o.outputs[0].token_ids for o in outs["EAGLE"]] == [o.outputs[0].token_ids for o in outs[None]]
    spec = outs["EAGLE"][0].spec
    for o in outs["EAGLE"][1:]:
        spec = spec + o.spec
    assert spec.verify_steps > 0 and spec.accept_length > 1.3


def test_load_head_reads_back_what_export_head_wrote(head_case):
    from training.train_draft_head import load_head

    _, model, head, token_map, path = head_case
    loaded, loaded_map = load_head(str(path), model)
    assert torch.equal(loaded_map, token_map)
    want, got = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
