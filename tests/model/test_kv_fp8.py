"""FP8 KV cache: stored bytes and reads against a reference quantise/dequantise, scale sources, and cases C37/C38.

C37: non-unit scales change the result and bring it closer to model-dtype KV than scales of
1.0 do; an absurd scale changes it drastically; stored K/V are never rescaled; scales are
reported with their source. C38: the decode path (DecodeMirror and page gather) reads the
same quantised KV with the same scales as prefill, so decoding token by token gives what one
prefill over the same tokens gives.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from radixserve.engine_config import EngineConfig
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.model_runner import ModelRunner
from tests.model.test_runner import Seq


def test_write_and_read_equal_reference_quantisation():
    torch.manual_seed(0)
    k_scale = torch.tensor([[0.05, 0.2]])
    v_scale = torch.tensor([[0.1, 0.02]])
    kv = KVCache(1, 4, 4, 2, 8, torch.float8_e4m3fn, compute_dtype=torch.float32,
                 k_scale=k_scale, v_scale=v_scale)
    k, v = torch.randn(6, 2, 8) * 3, torch.randn(6, 2, 8)
    k[0, 0, 0] = 1e4                                   # clipped to ±448 * scale, never inf/nan
    slots = torch.tensor([1, 2, 3, 4, 9, 15])
    k_in, v_in = k.clone(), v.clone()
    kv.write(0, slots, k, v)
    assert torch.equal(k, k_in) and torch.equal(v, v_in), "write must not mutate K/V"
    ref_k = (k / k_scale[0][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)   # (T, KV, D)
    stored = kv.export_pages([0, 1, 2, 3])
    flat_k = stored.k[0].reshape(2, 16, 8).transpose(0, 1)                         # (slots, KV, D)
    assert torch.equal(flat_k[slots].view(torch.uint8), ref_k.view(torch.uint8))
    got_k, got_v = kv.read_pages(0, torch.tensor([0, 1, 2, 3]))                     # (KV, 16, D)
    deq_k = ref_k.float() * k_scale[0][None, :, None]
    assert torch.equal(got_k.transpose(0, 1)[slots], deq_k)
    ref_v = (v / v_scale[0][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * v_scale[0][None, :, None]
    assert torch.equal(got_v.transpose(0, 1)[slots], ref_v)
    assert torch.isfinite(got_k).all() and float(got_k.abs().max()) == pytest.approx(448 * 0.05)
    rt_k, rt_v = kv.round_trip(0, k, v)                                             # what a read returns
    assert torch.equal(rt_k, deq_k) and torch.equal(rt_v, ref_v)


def test_attention_result_equals_sdpa_over_dequantised_kv(gqa_dir):
    runner = ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), page_size=4, max_total_tokens=512,
                                                  kv_cache_dtype="fp8_e4m3"))
    seq = Seq("a", [random.Random(0).randrange(3, 384) for _ in range(10)], list(range(8)))
    step_q = {}

    def capture(layer_id, q, k, v, attn):
        out = attn(layer_id, q, k, v)
        step_q[layer_id] = (q.clone(), out.clone())
        return out

    from radixserve.runner.batch import build_step
    batch = [seq.chunk()]
    step = build_step(batch, 4)
    attn = runner.backend.prepare(step)
    runner.model(step.input_ids, step.positions, lambda *a: capture(*a, attn), step.logit_rows)
    k, v = runner.kv.read_pages(0, torch.tensor([0, 1, 2]))                 # (KV, 12, D), dequantised
    q, out = step_q[0]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, :10], v[None, :, :10],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(out, ref.reshape(10, -1), atol=1e-5)


def run_greedy(runner: ModelRunner, prompt: list[int], steps: int, chunk: int | None = None) -> list:
    """Prefill `prompt` (in chunks of `chunk`), then decode; returns each sampled TokenLogprob."""
    seq = Seq("r", prompt, list(range(runner.num_pages)))
    out = []
    while len(out) < steps:
        sched = seq.chunk(chunk if len(seq.tokens) - seq.computed > 1 else None)
        res = runner.run([sched])[0]
        seq.computed = sched.start_pos + len(sched.input_ids)
        if res.token_ids:
            out.append(res.logprobs[-1])
            seq.output.append(res.token_ids[-1])
    return out


def fp8_runner(folder, scales_path=None, **kw) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=4, max_total_tokens=1024,
                                                kv_cache_dtype="fp8_e4m3", quantization_param_path=scales_path, **kw))


def write_scales(path, k: list, v: list) -> str:
    path.write_text(json.dumps({"k_scale": k, "v_scale": v}))
    return str(path)


def test_c37_scales_matter_and_are_reported(gqa_dir, tmp_path):
    prompts = [[random.Random(i).randrange(3, 384) for _ in range(24)] for i in range(4)]
    ref = ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), page_size=4, max_total_tokens=1024))
    runs = {"A": fp8_runner(gqa_dir, write_scales(tmp_path / "a.json", [0.002, 0.004], [0.001, 0.003])),
            "B": fp8_runner(gqa_dir, write_scales(tmp_path / "b.json", [1.0, 1.0], [1.0, 1.0])),
            "D": fp8_runner(gqa_dir, write_scales(tmp_path / "d.json", [1e-7, 1e-7], [1e-7, 1e-7]))}
    assert runs["A"].info()["kv_scales"] == {"source": "file", "k_scale": [0.002, 0.004], "v_scale": [0.001, 0.003]}
    err = {name: 0.0 for name in runs}
    for prompt in prompts:
        # prompt logprobs of every position: a dense comparison of the whole KV read path
        want = run_greedy(ref, prompt, 4)
        for name, runner in runs.items():
            got = run_greedy(runner, prompt, 4)
            err[name] += sum(abs(g.logprob - w.logprob) for g, w in zip(got, want)) / len(want)
    assert err["A"] != err["B"], "a non-unit scale must change the result"
    assert err["A"] < err["B"], f"scales {err} did not bring fp8 closer to model-dtype KV"
    assert err["D"] > 10 * err["A"], f"an absurd scale must change the output drastically: {err}"


def test_missing_scales_are_calibrated_loudly(gqa_dir, caplog):
    with caplog.at_level("WARNING"):
        runner = fp8_runner(gqa_dir)
    info = runner.info()["kv_scales"]
    assert info["source"] == "calibration"
    assert all(0 < s != 1.0 for s in info["k_scale"] + info["v_scale"])
    assert any("calibrated" in r.message for r in caplog.records)


def test_checkpoint_scales_win(gqa_dir, tmp_path):
    import shutil
    folder = tmp_path / "ckpt"
    shutil.copytree(gqa_dir, folder)
    weights = load_file(folder / "model.safetensors")
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.01 * (layer + 1))
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.03, 0.05])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    info = fp8_runner(folder).info()["kv_scales"]
    assert info == {"source": "checkpoint", "k_scale": [0.01, 0.02], "v_scale": [0.05, 0.05]}
    plain = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=4, max_total_tokens=1024))
    assert "kv_scales" not in plain.info()            # scales are read only for FP8 KV


def test_bad_scales_file_is_refused(gqa_dir, tmp_path):
    with pytest.raises(ValueError, match="one entry per layer"):
        fp8_runner(gqa_dir, write_scales(tmp_path / "short.json", [0.1], [0.1]))
    with pytest.raises(ValueError, match="finite and positive"):
        fp8_runner(gqa_dir, write_scales(tmp_path / "zero.json", [0.1, 0.0], [0.1, 0.1]))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_c38_decode_reads_what_prefill_reads(gqa_dir, tmp_path, kv_dtype):
    """Token-by-token decode (mirror, then page gather) == one prefill over the same tokens,
    and chunked prefill == one chunk, with non-unit scales."""
    scales = write_scales(tmp_path / "s.json", [0.003, 0.006], [0.002, 0.004])
    runner = ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), page_size=4, max_total_tokens=1024,
                                                  kv_cache_dtype=kv_dtype, quantization_param_path=scales))
    prompt = [random.Random(7).randrange(3, 384) for _ in range(30)]
    decoded = run_greedy(runner, prompt, 12)
    one_chunk = run_greedy(runner, prompt, 1)
    chunked = run_greedy(runner, prompt, 1, chunk=7)
    assert chunked[0].token_id == one_chunk[0].token_id
    assert abs(chunked[0].logprob - one_chunk[0].logprob) < 1e-3
    runner.backend = TorchAttentionBackend(runner.kv, mirror_bytes=0)
    gathered = run_greedy(runner, prompt, 12)
    assert [t.token_id for t in gathered] == [t.token_id for t in decoded]
    tokens = prompt + [t.token_id for t in decoded]
    for i in (3, 11):                                   # position i's token from one long prefill
        again = run_greedy(runner, tokens[:len(prompt) + i], 1)[0]
        assert again.token_id == decoded[i].token_id
        assert abs(again.logprob - decoded[i].logprob) < 1e-3
        assert abs(again.logprob - gathered[i].logprob) < 1e-3


def test_malformed_checkpoint_scales_are_refused():
    from radixserve.runner import kv_scales
    with pytest.raises(ValueError, match="one per KV head"):
        kv_scales.from_checkpoint({"model.layers.0.self_attn.k_scale": torch.ones(3)}, 2, 2)
    with pytest.raises(ValueError, match="N < 2"):
        kv_scales.from_checkpoint({"model.layers.7.self_attn.k_scale": torch.tensor(0.1)}, 2, 2)
    with pytest.raises(ValueError, match="finite and positive"):   # layer 1 and every v missing
        kv_scales.from_checkpoint({"model.layers.0.self_attn.k_scale": torch.tensor(0.1)}, 2, 2)
