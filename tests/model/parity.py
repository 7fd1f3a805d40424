"""Helpers for token-for-token parity against Hugging Face transformers (greedy, fp32)."""
from __future__ import annotations

import torch

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

TIE_GAP = 1e-4  # a top-2 logit gap below this is a numerical tie: either token is right
# The default model's parity prompts (test_parity.py; benchmarks/quantized.py scores them too).
PARITY_TEXTS = ["What is the capital of France?", "def fibonacci(n):", "Once upon a time",
                "The three primary colors are", "1, 2, 3, 4,", "Translate to French: I like apples.",
                "Write a haiku about the sea.", "import numpy as np\n", "Q: Why is the sky blue?\nA:",
                "Paris is"]
# The default model (135M) costs ~20x the tiny one per token: 16 new tokens per prompt there.
DEFAULT_NEW = 16


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation with transformers' own KV cache; returns tokens and the logits
    each token was chosen from (for the tie rule)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_tokens):
        step_logits = out.logits[0, -1].float()
        token = int(step_logits.argmax())
        tokens.append(token)
        logits.append(step_logits)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], num_tokens: int,
                    ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """`hf_greedy` of every prompt in one left-padded batch (attention mask and position ids
    as transformers' generate builds them): one forward per step for all prompts instead of
    one per prompt, the same tokens and logits up to fp32 reduction order (the tie rule's
    margin; test_parity.py checks the two agree on its prompts)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(num_tokens):
        step_logits = out.logits[:, -1].float()
        step_tokens = step_logits.argmax(-1)
        for i, (token, row) in enumerate(zip(step_tokens.tolist(), step_logits)):
            tokens[i].append(token)
            logits[i].append(row)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(step_tokens[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    return list(zip(tokens, logits))


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_parity(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], label: str) -> None:
    """Equal token ids, or a first difference at a true tie (gap < TIE_GAP)."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert i < len(ref) and i < len(ours), f"{label}: lengths differ ({len(ours)} vs {len(ref)})"
    gap = top2_gap(ref_logits[i])
    print(f"{label}: first difference at output position {i}: ours {ours[i]}, transformers "
          f"{ref[i]}, top-2 logit gap {gap:.3g}")
    assert gap < TIE_GAP, f"{label}: output differs at position {i} (top-2 gap {gap:.3g} is no tie)"


def engine_generate(engine: Engine, prompts: list[list[int]], num_tokens: int,
                    at_once: bool = True) -> tuple[list[list[int]], list[int]]:
    """Greedy generation of num_tokens per prompt (eos ignored). Returns the tokens and the
    cached-token count of each request; checks the page invariant after every step."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    base = len(engine.counters) and engine.counters["num_finished_requests"]
    order = []
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and (at_once or not engine.has_unfinished()):
            batch, pending = (pending, []) if at_once else (pending[:1], pending[1:])
            for i, prompt in batch:
                rid = f"p{base}-{i}"
                order.append(rid)
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
        engine.check_invariants()
    return [tokens[r] for r in order], [cached[r] for r in order]


def hf_gguf_model(path: str):
    """transformers' own GGUF loading (`load_gguf_checkpoint`: its dequantization and q/k
    un-permute) into a LlamaForCausalLM, fp32, parsing the file once. (`from_pretrained(...,
    gguf_file=...)` parses it twice, config then tensors: 30 s for the default model.) The
    model is shaped from radixserve's reading of the metadata, and the config transformers
    parses along with the tensors must agree with that shape on every field; the weights are
    transformers' alone."""
    import functools
    from unittest import mock

    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from radixserve.weights.loader import load_checkpoint

    mc, _ = load_checkpoint(path)   # radixserve's config (its conversion cache: read once)
    assert mc.architecture == "llama", mc.architecture
    config = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
                         intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
                         num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
                         head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
                         rope_theta=mc.rope_theta, max_position_embeddings=mc.max_position_embeddings,
                         tie_word_embeddings=mc.tie_word_embeddings)
    with no_init_weights():   # every weight is loaded below (the check after load_state_dict)
        model = LlamaForCausalLM(config).float().eval()
    # transformers builds gguf's TensorNameMap once per submodule (397 times here, ~6 s); the
    # map depends only on its (arch, n_blocks) arguments, so one build per pair serves them all.
    with mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)):
        loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    theirs = LlamaConfig.from_dict(loaded["config"])
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "rope_parameters"):
        assert getattr(theirs, field) == getattr(config, field), (field, getattr(theirs, field),
                                                                   getattr(config, field))
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model
