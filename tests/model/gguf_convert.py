"""Write a tiny transformers checkpoint as a GGUF file laid out as llama.cpp's convert_hf_to_gguf.py lays it out.

Independent of radixserve's own GGUF names: tensor names come from the `gguf` library's
`get_tensor_name_map` (what the converter's `map_tensor_name` uses), metadata from the keys each
converter class writes. What the converter does per architecture, and this file repeats:
- every class: the base `TextModel.set_gguf_parameters` keys (block count, lengths, heads,
  rope theta, RMS eps, expert count / used / groups, key and value length when config.json
  has `head_dim`), except ChatGLM (`GlmForCausalLM`), which writes its own: the RMS eps from
  `layernorm_epsilon` (default 1e-5, not `rms_norm_eps`), the context length from
  `seq_length` (default hidden size) and the rope dimension from hidden / heads;
- Llama: q/k rows permuted for llama.cpp's interleaved RoPE (no other architecture's are);
- GLM-4-0414, GLM-4.5, ChatGLM: `rope.dimension_count` = head_dim * partial_rotary_factor;
- Qwen3-MoE, GLM-4.5: experts stacked per layer into one (E, rows, cols) tensor per projection;
  GLM-4.5 also writes its MoE keys, counts its MTP layers in `block_count` and renames
  `e_score_correction_bias` to `e_score_correction.bias` (GGUF `exp_probs_b.bias`); the MTP layer N's extras
  (`eh_proj`, `enorm`, `hnorm`, `shared_head.norm` / `.head`, `embed_tokens`) map to `blk.N.nextn.*` by the same map;
- GLM-4.7-Flash (as DEEPSEEK2) and GLM-5 (as GLM_DSA), DeepseekV2Model's MLA rules: head_count_kv 1 (MLA as
  MQA), key_length / value_length kv_lora + rope / kv_lora, key_length_mla / value_length_mla nope + rope / v,
  q_lora_rank (when set), kv_lora_rank, rope dimension = qk_rope, leading_dense_block_count =
  first_k_dense_replace, expert_weights_norm only when true, no RoPE permutation, and kv_b_proj split per
  head into k_b_proj (transposed, (H, rank, nope)) and v_b_proj ((H, v, rank)), kv_b_proj itself not
  written; GLM-5 adds the indexer's head count, key length and top-k (gguf 0.19 has no key for IndexShare's
  layer types: a shared layer simply has no indexer tensors);
- 1-D tensors and the router (`ffn_gate_inp`) stay F32 whatever the output type.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE", "glm": "CHATGLM",
          "glm4": "GLM4", "glm4_moe": "GLM4_MOE", "glm4_moe_lite": "DEEPSEEK2", "glm_moe_dsa": "GLM_DSA"}
MLA_FAMILIES = ("glm4_moe_lite", "glm_moe_dsa")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Llama q/k row permutation (the inverse of what radixserve undoes)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, path, types: dict[str, str] | None = None, fuse_qkv: bool = False) -> None:
    """Convert the checkpoint in `hf_dir` (config.json + model.safetensors) to GGUF at `path`.
    `types`: GGUF tensor-name part ("attn_q", "ffn_gate_exps", "token_embd", ...) -> quantization
    type name ("Q8_0", "Q4_0", ...), quantized with `gguf.quants.quantize`; the rest stays F32.
    `fuse_qkv`: write q/k/v as one `attn_qkv` tensor, as ChatGLM's remote-code checkpoints
    (`query_key_value`) convert."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    family = cfg["model_type"]
    arch = getattr(gguf.MODEL_ARCH, ARCHES[family])
    tensors = {k: v.astype(np.float32) for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    mtp = family in ("glm4_moe", *MLA_FAMILIES)
    block_count = cfg["num_hidden_layers"] + ((cfg.get("num_nextn_predict_layers") or 0) if mtp else 0)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, family, cfg, block_count)
    names = gguf.get_tensor_name_map(arch, block_count)
    for name, array in _converted(family, cfg, tensors, fuse_qkv):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name, f"llama.cpp's converter cannot map {name} for {family}"
        qtype = (types or {}).get(gguf_name.split(".")[-2])
        if qtype is None or array.ndim < 2 or ".ffn_gate_inp." in gguf_name:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _converted(family: str, cfg: dict, tensors: dict[str, np.ndarray], fuse_qkv: bool):
    """(transformers-side name, array) in the converter's layout (see the module docstring)."""
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, a in tensors.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = a
        elif family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            yield name, permute_qk(a, heads)
        elif family in MLA_FAMILIES and name.endswith("kv_b_proj.weight"):
            yield from _split_kv_b(cfg, name, a)
        elif name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), a
        elif fuse_qkv and ".self_attn.q_proj." in name:
            yield name.replace("q_proj", "query_key_value"), np.concatenate(
                [tensors[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
        elif not (fuse_qkv and (".self_attn.k_proj." in name or ".self_attn.v_proj." in name)):
            yield name, a
    for (prefix, projection), by_expert in experts.items():
        yield f"{prefix}.{projection}.weight", np.stack([by_expert[e] for e in sorted(by_expert)])


def _split_kv_b(cfg: dict, name: str, a: np.ndarray):
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    per_head = a.reshape(cfg["num_attention_heads"], nope + v, a.shape[-1])
    yield name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    yield name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(per_head[:, nope:])


def _write_mla_metadata(w, family: str, cfg: dict) -> None:
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    types = cfg.get("mlp_layer_types")
    first = cfg.get("first_k_dense_replace", 0)
    assert types is None or types == ["dense"] * first + ["sparse"] * (len(types) - first), \
        "GGUF holds only a leading dense block count"
    w.add_leading_dense_block_count(first)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if cfg.get("num_nextn_predict_layers"):
        w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    if family == "glm_moe_dsa":
        w.add_indexer_head_count(cfg["index_n_heads"])
        w.add_indexer_key_length(cfg["index_head_dim"])
        w.add_indexer_top_k(cfg["index_topk"])


def _write_metadata(w, family: str, cfg: dict, block_count: int) -> None:
    import gguf

    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    w.add_block_count(block_count)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if family in MLA_FAMILIES else cfg["num_key_value_heads"])
    _write_vocab(w, cfg)
    if family == "glm":   # ChatGLMModel.set_gguf_parameters replaces the base class's keys
        w.add_context_length(cfg.get("seq_length", hidden))
        w.add_layer_norm_rms_eps(cfg.get("layernorm_epsilon", 1e-5))
        w.add_rope_dimension_count(int(hidden // heads * partial))
        w.add_rope_freq_base(10000 * cfg.get("rope_ratio", 1))
        return
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    for key, add in (("num_local_experts", w.add_expert_count), ("num_experts_per_tok", w.add_expert_used_count),
                     ("n_group", w.add_expert_group_count), ("topk_group", w.add_expert_group_used_count)):
        if cfg.get(key) is not None:
            add(cfg[key])
    if family in MLA_FAMILIES:
        # The sigmoid routing these models use (llama.cpp's deepseek2 loader reads a file without the key as softmax).
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        _write_mla_metadata(w, family, cfg)
        return
    head_dim = cfg.get("head_dim") or hidden // heads
    if "head_dim" in cfg:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if family == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if family in ("glm4", "glm4_moe"):
        w.add_rope_dimension_count(int(head_dim * partial))
    if family in ("qwen3_moe", "glm4_moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "glm4_moe":
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])


def _write_vocab(w, cfg: dict) -> None:
    """A placeholder BPE vocabulary of the config's size, with its bos / eos ids."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
