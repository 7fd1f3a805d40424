"""EAGLE / NEXTN from a GGUF file holding the NextN (MTP) layer as llama.cpp's converter writes it (issue 41; C53).

mtp_checkpoint.py's tiny glm4_moe with one MTP layer, written by gguf_convert.py: block_count 4, nextn_predict_layers
1, the layer's block under blk.3.* and its extras under blk.3.nextn.*. Its tensors equal the safetensors checkpoint's
(F32) or their Q8_0 round trip; drafts equal transformers' MtpModel chain; greedy output equals no speculation; a file
without the layer or part of it fails the load naming what is missing. glm_moe_dsa (glm-dsa, its MTP layer a full DSA
layer with k_b / v_b halves): tensors and drafts in one scenario."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from radixserve.weights.loader import load_checkpoint
from tests.model.gguf_convert import write_gguf
from tests.model.mtp_checkpoint import build_glm_mtp
from tests.model.parity import engine_generate
from tests.model.test_mtp import EAGLE, check_drafts_in_scenario, check_greedy_equals_no_speculation, rewrite, runner
from tests.model.test_parity import make_engine, prompt_set

LAYER = "model.layers.3."
Q8_0 = {p: "Q8_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up_exps", "eh_proj",
                            "shared_head_head", "embed_tokens")}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-mtp-cache"))


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    """(F32 .gguf path, hf model, hf MtpModel); the layer stores its own embed_tokens / shared_head.head copies."""
    folder = tmp_path_factory.mktemp("glm_mtp_gguf")
    model, mtp = build_glm_mtp(folder / "hf", shared_copies=True)
    write_gguf(folder / "hf", folder / "f32.gguf")
    return folder / "f32.gguf", model, mtp


def layer_tensors(path) -> dict[str, torch.Tensor]:
    return {n: t for n, t in load_checkpoint(str(path))[1] if n.startswith(LAYER)}


def assert_layer_equal(gguf_path) -> dict[str, torch.Tensor]:
    ref, got = layer_tensors(gguf_path.parent / "hf"), layer_tensors(gguf_path)
    assert sorted(got) == sorted(ref) and len(ref) > 30
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name
    return ref


def test_the_nextn_layer_loads_as_stored(gguf_case, tmp_path):
    """F32: every model.layers.3.* tensor bit for bit (experts unstacked, GGUF nextn.* names mapped back); Q8_0:
    dequantized as the rest of the file; --quantization int8 keeps the layer float (nextn_loader loads tensors)."""
    import gguf

    path = gguf_case[0]
    assert load_checkpoint(str(path))[0].num_layers == 3
    ref = assert_layer_equal(path)

    write_gguf(path.parent / "hf", tmp_path / "q8.gguf", Q8_0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    deq = dict(load_checkpoint(str(tmp_path / "q8.gguf"))[1])
    for short in ("eh_proj.weight", "shared_head.head.weight", "self_attn.q_proj.weight"):
        a = ref[LAYER + short].numpy()
        want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8).astype(np.float32))
        assert not torch.equal(want, ref[LAYER + short]) and torch.equal(deq[LAYER + short], want), short
    int8 = dict(load_checkpoint(str(tmp_path / "q8.gguf"), "int8")[1])
    assert all(type(int8[n]) is torch.Tensor for n in ref)
    assert type(int8["model.layers.1.self_attn.q_proj.weight"]) is not torch.Tensor


@pytest.mark.parametrize("name", ["b_all_at_once", "d_small_chunks"])
def test_drafts_equal_transformers_mtp(gguf_case, name):
    engine = check_drafts_in_scenario(gguf_case, name)
    assert "equal to the target's, shared" in engine.runner.info()["nextn_draft"]["head"]


def test_a_quantized_head_copy_is_shared_when_equal(gguf_case, tmp_path):
    """int4 on Q4_0: blk.3.nextn.shared_head_head dequantizes to the target's int4 head exactly, so it is shared;
    int8 requantizes the target's head, so the float copy is the layer's own. Drafting runs on the int4 target."""
    write_gguf(gguf_case[0].parent / "hf", tmp_path / "q4.gguf", {p: "Q4_0" for p in ("output", "shared_head_head")})
    assert "equal to the target's, shared" in runner(tmp_path / "q4.gguf", quantization="int4").info()[
        "nextn_draft"]["head"]
    assert "(its own)" in runner(tmp_path / "q4.gguf", quantization="int8").info()["nextn_draft"]["head"]
    engine = make_engine(tmp_path / "q4.gguf", quantization="int4", **EAGLE)
    engine_generate(engine, prompt_set(256, 1, [5, 40]), 8)
    assert engine.stats()["spec_num_verify_steps"] > 0


def test_glm_moe_dsa_nextn_layer_from_gguf(tmp_path):
    model, mtp = build_glm_mtp(tmp_path / "hf", family="glm_moe_dsa", num_nextn_predict_layers=1,
                               index_topk_pattern="FSF")
    write_gguf(tmp_path / "hf", tmp_path / "f32.gguf")
    assert any(".indexer." in n for n in assert_layer_equal(tmp_path / "f32.gguf"))
    check_drafts_in_scenario((tmp_path / "f32.gguf", model, mtp), "b_all_at_once")


def test_greedy_equals_no_speculation(gguf_case):
    check_greedy_equals_no_speculation(gguf_case[0], "e_preemption")


@pytest.mark.parametrize("case, error", [
    ("no_layer", r"no NextN \(MTP\) layer: no tensor GGUF blk\.3\.\* \(counted by nextn_predict_layers\)"),
    ("no_eh_proj", r"lacks model\.layers\.3\.eh_proj\.weight \(GGUF blk\.3\.nextn\.eh_proj\.weight\)"),
    ("no_norms", r"lacks model\.layers\.3\.hnorm\.weight \(GGUF blk\.3\.nextn\.hnorm\.weight\), "
                 r"model\.layers\.3\.shared_head\.norm\.weight \(GGUF blk\.3\.nextn\.shared_head_norm\.weight\)"),
    ("no_attn_q", r"NextN layer of .*f32\.gguf, model\.layers\.3\.\*: checkpoint lacks 1 parameters"
                  r".*qkv_proj\.weight:q"),
])
def test_missing_nextn_tensors_fail_the_load(gguf_case, tmp_path, case, error):
    """C53 from GGUF: a file converted without the layer, or with part of it, is a load error under EAGLE."""
    shutil.copytree(gguf_case[0].parent / "hf", tmp_path / "hf")
    drop = {"no_layer": (), "no_eh_proj": ("eh_proj.weight",),
            "no_norms": ("hnorm.weight", "shared_head.norm.weight"), "no_attn_q": ("self_attn.q_proj.weight",)}[case]
    rewrite(tmp_path / "hf", lambda t: [t.pop(k) for k in [k for k in t if k.startswith(LAYER)
                                                           and (not drop or k.removeprefix(LAYER) in drop)]])
    write_gguf(tmp_path / "hf", tmp_path / "f32.gguf")
    with pytest.raises(ValueError, match=error):
        runner(tmp_path / "f32.gguf")
