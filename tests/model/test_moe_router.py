"""C59: the noaux_tc router (glm4_moe, glm4_moe_lite, glm_moe_dsa; models/moe.py Router) against transformers' fp32
router, with GLM-5.2-like correction biases 7.0 + U(-0.12, 0.12) that bf16 would collapse (step 0.03125 near 7):
per token the selected experts and their weights, on both Router paths (F.linear and the packed batch-invariant one),
model dtype fp32 and bf16, n_group / topk_group 1/1 and 2/1; the bias stays fp32 after loading, also from an int4
GGUF; weights are the unbiased scores, renormalised, times routed_scaling_factor exactly once."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.engine_config import EngineConfig
from radixserve.models.moe import Router
from radixserve.runner.model_runner import ModelRunner
from tests.model.gguf_convert import write_gguf
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_mla import forward_logits
from tests.model.test_runner import Seq

SCALING = 2.5
TIE = 1e-6
BIAS = "mlp.gate.e_score_correction_bias"


def build(folder, family: str, groups: tuple[int, int], **more):
    """A tiny checkpoint (test_families.py) with routed_scaling_factor 2.5, (n_group, topk_group) = groups and every
    layer's correction bias 7.0 + U(-0.12, 0.12) in fp32."""
    config_cls, model_cls, base = FAMILIES[family]
    extra = {"n_group": groups[0], "topk_group": groups[1], "routed_scaling_factor": SCALING, "vocab_size": 512,
             **more}
    build_family(folder, family, seed=2, spec=(config_cls, model_cls, {**base, **extra}))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(9)
    for name in [n for n in tensors if n.endswith(BIAS)]:
        tensors[name] = 7.0 + (torch.rand(tensors[name].shape, generator=gen, dtype=torch.float64) * 0.24 - 0.12)
        tensors[name] = tensors[name].float()
    save_file(tensors, path, metadata={"format": "pt"})
    return folder, {n: t for n, t in tensors.items() if n.endswith(BIAS)}


def routed(runner: ModelRunner, n: int = 96) -> dict[str, list[torch.Tensor]]:
    """Each Router's input rows over one prefill of n tokens plus 3 decodes, by module name."""
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: inputs.setdefault(name, []).append(args[0]))
             for name, m in runner.model.named_modules() if isinstance(m, Router)]
    rng = random.Random(1)
    seq = Seq("a", [rng.randrange(3, 512) for _ in range(n)], list(range(runner.num_pages))[::-1])
    with torch.inference_mode():
        logits = forward_logits(runner, seq, n)
        for _ in range(3):
            seq.output.append(int(logits[-1].argmax()))
            logits = forward_logits(runner, seq, 1)
    for h in hooks:
        h.remove()
    return inputs


def compare(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor],
            choice: torch.Tensor, label: str) -> int:
    """Per token: the same expert set (a difference only where the k-th and (k+1)-th biased scores tie within TIE),
    weights within 1e-5 matched by expert id. Returns the number of tied tokens."""
    (w, ids), (w_ref, ids_ref) = ours, theirs
    ids, order = ids.sort(-1)
    ids_ref, order_ref = ids_ref.sort(-1)
    differ = (ids != ids_ref).any(-1)
    if differ.any():
        top = choice[differ].topk(ids.shape[1] + 1, -1).values
        gaps = top[:, -2] - top[:, -1]
        assert float(gaps.max()) <= TIE, f"{label}: {int(differ.sum())} tokens pick other experts ({gaps.max():.3g})"
    same = ~differ
    err = (w.gather(1, order) - w_ref.gather(1, order_ref))[same].abs().max()
    assert float(err) <= 1e-5, f"{label}: weights differ by {float(err):.3g}"
    return int(differ.sum())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("groups", [(1, 1), (2, 1)])
@pytest.mark.parametrize("family", ["glm4_moe", "glm4_moe_lite", "glm_moe_dsa"])
@torch.inference_mode()
def test_c59_router_matches_transformers_fp32_router(tmp_path, family, groups, dtype):
    from transformers import AutoModelForCausalLM

    folder, biases = build(tmp_path, family, groups)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), dtype=dtype, max_total_tokens=512,
                                                  page_size=16))
    routers = {n: m for n, m in runner.model.named_modules() if isinstance(m, Router)}
    assert len(routers) == len(biases) > 0
    for name, router in routers.items():
        bias = router.e_score_correction_bias
        assert bias.dtype == torch.float32 and torch.equal(bias, biases[f"{name}.e_score_correction_bias"]), name
        assert len(torch.unique(bias.to(torch.bfloat16))) < len(torch.unique(bias))   # bf16 would collapse it
    collapsed = 0
    for name, xs in routed(runner).items():
        gate = hf.get_submodule(name)
        x = torch.cat(xs)
        _, w_ref, ids_ref = gate(x.float())
        scores = torch.sigmoid(x.float() @ gate.weight.T)
        choice = scores + gate.e_score_correction_bias
        for batch_invariant in (False, True):
            routers[name].prepare(batch_invariant)
            w, ids = routers[name](x)
            assert w.dtype == torch.float32
            compare((w, ids), (w_ref, ids_ref), choice, f"{name} batch_invariant={batch_invariant}")
            # unbiased scores, renormalised, x routed_scaling_factor once (the weights sum to it exactly)
            picked = scores.gather(1, ids)
            assert torch.allclose(w, picked / picked.sum(-1, keepdim=True) * SCALING, atol=1e-6, rtol=0)
            assert torch.allclose(w.sum(-1), torch.full_like(w[:, 0], SCALING), atol=1e-5, rtol=0)
        routers[name].prepare(False)
        # the test can fail: the bias rounded to bf16 picks other experts for some tokens
        rounded = scores + gate.e_score_correction_bias.to(torch.bfloat16).float()
        if groups == (1, 1):
            rounded_ids = rounded.topk(gate.top_k, -1).indices.sort(-1).values
            collapsed += int((rounded_ids != ids_ref.sort(-1).values).any(-1).sum())
    assert groups != (1, 1) or collapsed > 0


@torch.inference_mode()
def test_c59_bias_stays_fp32_from_an_int4_gguf(tmp_path, monkeypatch):
    """The int4 GGUF path (Q4_0 linear weights, bf16 model): the router bias loads fp32 and bit-exact."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder, biases = build(tmp_path / "hf", "glm4_moe_lite", (1, 1), first_k_dense_replace=1)
    q4 = {part: "Q4_0" for part in ("token_embd", "output", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "ffn_gate",
                                    "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")}
    write_gguf(folder, tmp_path / "q4_0.gguf", q4)
    runner = ModelRunner.from_config(EngineConfig(model_path=str(tmp_path / "q4_0.gguf"), dtype="bfloat16",
                                                  quantization="int4", max_total_tokens=512, page_size=16))
    assert any(getattr(m, "quantized", False) for m in runner.model.modules())
    for name, router in ((n, m) for n, m in runner.model.named_modules() if isinstance(m, Router)):
        bias = router.e_score_correction_bias
        assert bias.dtype == torch.float32 and torch.equal(bias, biases[f"{name}.e_score_correction_bias"]), name
