"""Triton attention backend vs transformers and vs the torch backend on tiny random Llamas.

Without a CUDA device the kernels run under the Triton interpreter (TRITON_INTERPRET=1, numpy
on CPU tensors: slow, so a few steps per scenario); with one they run natively on cuda.
Skipped where triton is not installed, except under RADIXSERVE_CI=1 (install.sh installs it), where it fails.

Every Attention call runs both backends over the same KVCache (DualBackend): their outputs
must agree per layer (fp32: 1e-5 on CPU, 5e-5 on CUDA), and the triton output carries on, so
the Harness's checks against transformers (greedy id, top-5 logprobs within 1e-4) are checks of the triton backend.
FP8 KV (non-unit scales) is compared with the torch backend only: per layer on the same FP8
cache, and end to end (tokens, logprobs within 1e-4) against a torch-backend runner.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # read when the kernels are defined: before triton's import
if importlib.util.find_spec("triton") is None and os.environ.get("RADIXSERVE_CI") == "1":
    pytest.fail("RADIXSERVE_CI=1 and no triton: install.sh should have installed it", pytrace=False)
pytest.importorskip("triton")

from radixserve.engine_config import EngineConfig  # noqa: E402
from radixserve.runner.attention.base import BACKENDS, create_backend  # noqa: E402
from radixserve.runner.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.runner.kv_cache import KVCache  # noqa: E402
from radixserve.runner.model_runner import ModelRunner  # noqa: E402
from tests.model.test_runner import Harness, Seq, mixed_batch_scenario  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYER_ATOL = 1e-5 if DEVICE == "cpu" else 5e-5   # fp32, per layer; GPU kernels sum in other orders


class DualBackend:
    """The torch and the triton backend over one KVCache: each layer runs both (both write the
    same k, v to the same slots), asserts they agree within `atol`, and returns triton's output."""

    name = "dual"

    def __init__(self, kv: KVCache, atol: float):
        self.kv, self.atol, self.max_diff = kv, atol, 0.0
        self.torch = TorchAttentionBackend(kv, mirror_bytes=0)
        self.triton = TritonAttentionBackend(kv)

    def prepare(self, step):
        ref_attn, attn = self.torch.prepare(step), self.triton.prepare(step)

        def attend(layer_id, q, k, v):
            ref = ref_attn(layer_id, q, k, v)
            got = attn(layer_id, q, k, v)
            assert got.dtype == q.dtype and got.shape == ref.shape
            diff = float((ref.float() - got.float()).abs().max())
            self.max_diff = max(self.max_diff, diff)
            assert diff <= self.atol, f"layer {layer_id}: triton differs from torch by {diff:.3g}"
            return got

        return attend


def harness(folder, page_size: int, seed: int = 0, atol: float = LAYER_ATOL, **config) -> Harness:
    h = Harness(folder, page_size, seed, device=DEVICE, attention_backend="triton", **config)
    assert h.runner.backend.name == "triton"
    h.runner.backend = DualBackend(h.runner.kv, atol)
    return h


def test_registered_and_auto_choice():
    assert "triton" in BACKENDS
    kv = KVCache(1, 4, 4, 2, 16, torch.float32, DEVICE)
    assert create_backend("auto", kv, torch.device("cpu")).name == "torch"
    if DEVICE == "cuda":
        assert create_backend("auto", kv, torch.device("cuda")).name == "triton"
    assert create_backend("triton", kv, torch.device(DEVICE)).name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("flash", kv, torch.device(DEVICE))


@pytest.mark.parametrize("page_size", [1, 16])
def test_single_prefill_then_decode(gqa_dir, page_size):
    h = harness(gqa_dir, page_size)
    seq = h.new_seq("a", 37)
    for _ in range(4):
        h.step([(seq, seq.chunk())])
    assert len(seq.output) == 4


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_across_steps(gqa_dir, page_size):
    h = harness(gqa_dir, page_size, seed=page_size)
    seq = h.new_seq("a", 45)
    for n in (7, 16, 1, 9):            # start_pos 0, 7, 23, 24: partial pages, a 1-token chunk
        h.step([(seq, seq.chunk(n))])
    h.step([(seq, seq.chunk())])
    h.step([(seq, seq.chunk())])
    assert len(seq.output) == 2


@pytest.mark.parametrize("decodes_first", [True, False])
def test_mixed_batch_mha(mha_dir, decodes_first):
    mixed_batch_scenario(harness(mha_dir, 16, seed=5), decodes_first, mixed_steps=2)


def test_decodes_of_different_lengths(gqa_dir):
    """Contexts shorter than, equal to and longer than one key block (64) and a page (16)."""
    h = harness(gqa_dir, 16, seed=9)
    seqs = [h.new_seq(f"s{i}", n) for i, n in enumerate([1, 16, 17, 64, 70])]
    h.step([(s, s.chunk()) for s in seqs])
    h.step([(s, s.chunk()) for s in seqs])
    assert all(len(s.output) == 2 for s in seqs)


def test_bfloat16_close_to_float32_transformers(gqa_dir):
    """bf16 weights, activations and KV: the greedy pick is (near-)best under fp32 transformers."""
    h = harness(gqa_dir, 16, seed=11, atol=3e-2, dtype="bfloat16")
    assert h.runner.kv.dtype == torch.bfloat16
    seq = h.new_seq("a", 40)
    for chunk in (25, None, None, None):
        result = h.runner.run([seq.chunk(chunk)])[0]
        seq.computed = len(seq.tokens) if chunk is None else chunk
        if not result.token_ids:
            continue
        res = result.logprobs[-1]
        ref = h.reference(seq.tokens)[-1]
        assert float(ref.max() - ref[res.token_id]) < 0.05
        assert abs(res.logprob - float(ref[res.token_id])) < 0.05
        seq.output.append(res.token_id)
    assert len(seq.output) == 3


def fp8_runner(folder, scales: str, backend: str, kv_dtype: str) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(
        model_path=str(folder), page_size=4, max_total_tokens=1024, device=DEVICE, kv_cache_dtype=kv_dtype,
        quantization_param_path=scales, attention_backend=backend))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_equals_torch_backend(gqa_dir, tmp_path, kv_dtype):
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"k_scale": [0.02, 0.05], "v_scale": [0.01, 0.03]}))
    runners = {b: fp8_runner(gqa_dir, str(scales), b, kv_dtype) for b in ("torch", "triton")}
    runners["triton"].backend = DualBackend(runners["triton"].kv, LAYER_ATOL)   # per layer, same cache
    for runner in runners.values():   # distinct scales per KV head too (the file gives one per layer)
        assert torch.allclose(runner.kv.k_scale.cpu(), torch.tensor([[0.02, 0.02], [0.05, 0.05]]))
        runner.kv.k_scale.mul_(torch.tensor([[1.0, 2.0], [0.5, 1.5]], device=DEVICE))
        runner.kv.v_scale.mul_(torch.tensor([[3.0, 1.0], [1.0, 0.25]], device=DEVICE))
    rng = random.Random(3)
    prompts = {rid: [rng.randrange(3, 384) for _ in range(n)] for rid, n in (("a", 30), ("b", 13))}
    seqs = {b: {rid: Seq(rid, p, list(range(i * 32, (i + 1) * 32))) for i, (rid, p) in enumerate(prompts.items())}
            for b in runners}
    plan = [[("a", 12)], [("a", None), ("b", 5)], [("b", None), ("a", None)], [("a", None), ("b", None)]]
    for items in plan:
        results = {}
        for b, runner in runners.items():
            batch = [seqs[b][rid].chunk(n) for rid, n in items]
            results[b] = runner.run(batch)
            for sched, res in zip(batch, results[b]):
                s = seqs[b][sched.request_id]
                s.computed = sched.start_pos + len(sched.input_ids)
                if res.token_ids:
                    s.output.append(res.token_ids[-1])
        for want, got in zip(results["torch"], results["triton"]):
            assert (not want.token_ids) == (not got.token_ids)
            if want.token_ids:
                assert got.token_ids[-1] == want.token_ids[-1]
                assert abs(got.logprobs[-1].logprob - want.logprobs[-1].logprob) < 1e-4
                assert [t for t, _ in got.logprobs[-1].top] == [t for t, _ in want.logprobs[-1].top]
    assert len(seqs["triton"]["a"].output) == 3 and len(seqs["triton"]["b"].output) == 2
