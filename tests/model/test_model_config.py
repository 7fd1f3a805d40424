"""ModelConfig normalisation from transformers 4.x / 5.x config dicts and GGUF metadata."""
from __future__ import annotations

import pytest

from radixserve.models.model_config import ModelConfig, RopeScaling

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=4096, eos_token_id=[2, 7], bos_token_id=1)


def test_hf_4x_rope_scaling_and_defaults():
    c = ModelConfig.from_hf({**BASE, "rope_theta": 500000.0, "tie_word_embeddings": True,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert (c.head_dim, c.num_kv_heads, c.rope_theta, c.eos_token_ids) == (16, 2, 500000.0, (2, 7))
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.tie_word_embeddings and not c.qkv_bias


def test_hf_5x_rope_parameters():
    c = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}})
    assert c.rope_theta == 123.0 and c.rope_scaling == RopeScaling("linear", 2.0)
    assert ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}).rope_scaling is None


def test_flags_for_relatives_and_unsupported():
    assert ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias
    assert ModelConfig.from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"]}).qk_norm
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gguf_metadata_and_json_round_trip():
    meta = {"general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
            "llama.embedding_length": 576, "llama.feed_forward_length": 1536,
            "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
            "llama.rope.freq_base": 100000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 49152, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}
    c = ModelConfig.from_gguf(meta, tensor_names={"token_embd.weight"})
    assert (c.num_layers, c.head_dim, c.num_kv_heads, c.tie_word_embeddings, c.eos_token_ids) == (30, 64, 3, True, (2,))
    assert ModelConfig.from_json(c.to_json()) == c


def test_generation_config_eos_ids_are_merged(tmp_path):
    import json

    from radixserve.weights.safetensors import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    assert ModelConfig.from_hf(read_hf_config(str(tmp_path))).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_hf(read_hf_config(str(tmp_path))).eos_token_ids == (2, 9)
