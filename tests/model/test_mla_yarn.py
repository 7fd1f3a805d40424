"""C44: YaRN RoPE on MLA (DeepSeek-V2's parameterisation) against transformers 5.25: the rotary's frequencies and its
cos / sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), the whole softmax scale by
mscale(factor, mscale_all_dim)^2, at every position past the original window, on every path (prefill, decode, chunked
prefill, a prefix hit), for glm4_moe_lite and the sparse deepseek_v32; GLM's default RoPE keeps (nope + rope)^-0.5."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine_config import EngineConfig
from radixserve.models.mla import MLAAttention
from radixserve.models.model_config import ModelConfig
from radixserve.runner.model_runner import ModelRunner
from tests.model.test_families import FAMILIES, build_family
from tests.model.test_mla import forward_logits
from tests.model.test_runner import Seq

PAGE = 16
ATOL = 1e-3   # C44's bound; the fp32 runs agree within about 1e-5
# (mscale, mscale_all_dim): DeepSeek-V2-Lite-like (rotary ratio 1.0), V3-like, and a ratio != 1 (cos / sin x 1.07).
MSCALES = [(0.707, 0.707), (1.0, 1.0), (1.0, 0.8)]
LENGTHS = [1, 2, 17, 33, 200]   # 200: past original_max_position_embeddings (32)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim, "beta_fast": 32.0, "beta_slow": 1.0}


def build(folder, family: str, rope: dict | None):
    config_cls, model_cls, base = FAMILIES[family]
    extra = {"rope_parameters": rope} if rope else {}
    return build_family(folder, family, seed=3, spec=(config_cls, model_cls, {**base, "vocab_size": 512, **extra}))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run(runner: ModelRunner, seq: Seq, chunks: list[int], decodes: int) -> torch.Tensor:
    """`seq`'s uncomputed prompt in `chunks`, then greedy decodes; every row's logits (rows, V)."""
    out = [forward_logits(runner, seq, n) for n in chunks]
    for _ in range(decodes):
        seq.output.append(int(out[-1][-1].argmax()))
        out.append(forward_logits(runner, seq, 1))
    return torch.cat(out)


def check(hf, seq: Seq, ours: torch.Tensor, first: int, label: str) -> None:
    """ours = logits of positions [first, seq.computed) within ATOL of transformers' one forward, at every position."""
    with torch.inference_mode():
        ref = hf(torch.tensor([seq.tokens])).logits[0, first:seq.computed]
    err = (ours - ref).abs().amax(-1)
    assert float(err.max()) <= ATOL, f"{label}: max |dlogit| {float(err.max()):.3g} at row {int(err.argmax())}"


def check_every_path(hf, runner: ModelRunner, lengths: list[int], label: str = "") -> None:
    """`runner`'s (page size PAGE) logits within ATOL of `hf`'s at every position: a one-shot prefill of each length then 4 decodes;
    a 200-token prompt in chunks ending at 17, 33 and 200, then 3 decodes; a prefix hit reading its first 64 tokens
    from the pages of that prompt, 40 more, then 3 decodes. Prompt ids are in [3, 512)."""
    free = list(range(runner.num_pages))[::-1]

    def new_seq(tokens: list[int], shared: list[int] = ()) -> Seq:
        pages = list(shared) + [free.pop() for _ in range(-(-(len(tokens) + 8) // PAGE) - len(shared))]
        return Seq(f"s{len(free)}", tokens, pages)

    for n in lengths:                                          # one-shot prefill, then decodes
        seq = new_seq(prompt(n, seed=n))
        check(hf, seq, run(runner, seq, [n], decodes=4), 0, f"{label}prefill {n}")
    long = new_seq(prompt(200, seed=7))                        # chunked prefill: chunks end at 17, 33, 200
    check(hf, long, run(runner, long, [17, 16, 167], decodes=3), 0, f"{label}chunked")
    hit = new_seq(long.prompt[:64] + prompt(40, seed=8), shared=long.pages[:64 // PAGE])
    hit.computed = 64                                          # a prefix hit: 64 tokens read from long's pages
    check(hf, hit, run(runner, hit, [40], decodes=3), 64, f"{label}prefix hit")


@pytest.mark.parametrize("family,mscales", [("glm4_moe_lite", m) for m in MSCALES]
                         + [("deepseek_v32", MSCALES[2])])
@torch.inference_mode()
def test_c44_yarn_logits_equal_transformers_on_every_path(tmp_path, family, mscales):
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path, family, yarn(*mscales))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=PAGE, max_total_tokens=2048))
    attn = next(m for m in runner.model.modules() if isinstance(m, MLAAttention))
    # the debug view: the softmax scale actually used, and the cos / sin scale (cos at position 0)
    assert attn.softmax_scale == hf.model.layers[0].self_attn.scaling > (attn.nope + attn.rope) ** -0.5
    assert float(runner.model.rotary.cos_cache[0, 0]) == pytest.approx(hf.model.rotary_emb.attention_scaling, 1e-7)
    check_every_path(hf, runner, LENGTHS)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "glm_moe_dsa"])
def test_c44_default_rope_keeps_the_plain_softmax_scale(tmp_path, family):
    """Released GLM MLA models use default RoPE: the scale stays exactly (nope + rope)^-0.5, cos / sin unscaled."""
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path, family, None)
    runner = ModelRunner.from_config(EngineConfig(model_path=str(folder), page_size=PAGE, max_total_tokens=512))
    assert runner.model_config.rope_scaling is None
    nope, rope = FAMILIES[family][2]["qk_nope_head_dim"], FAMILIES[family][2]["qk_rope_head_dim"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for attn in (m for m in runner.model.modules() if isinstance(m, MLAAttention)):
        assert attn.softmax_scale == (nope + rope) ** -0.5 == hf.model.layers[0].self_attn.scaling
    assert float(runner.model.rotary.cos_cache[0, 0]) == 1.0


def test_c44_yarn_is_refused_where_it_is_not_implemented():
    """Non-MLA families (transformers applies no softmax mscale there; not compared here) and GGUF metadata refuse
    yarn at load with a message naming it, rather than serving plain RoPE."""
    cfg = {**FAMILIES["qwen3"][2], "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": yarn(1.0, 1.0)}
    with pytest.raises(ValueError, match="'yarn' is supported for MLA models only"):
        ModelConfig.from_hf(cfg)
    meta = {"general.architecture": "deepseek2", "deepseek2.rope.scaling.type": "yarn"}
    with pytest.raises(ValueError, match="'yarn' is not read from GGUF"):
        ModelConfig.from_gguf(meta, ())
    mla = {**FAMILIES["glm4_moe_lite"][2], **{k: v for k, v in cfg.items() if k != "architectures"},
           "architectures": ["Glm4MoeLiteForCausalLM"], "num_hidden_layers": 3}
    parsed = ModelConfig.from_hf(mla).rope_scaling
    assert (parsed.rope_type, parsed.factor, parsed.original_max_position_embeddings) == ("yarn", 40.0, 32)
    assert ModelConfig.from_json(ModelConfig.from_hf(mla).to_json()).rope_scaling == parsed
