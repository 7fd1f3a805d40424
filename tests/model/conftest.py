"""Fixtures of the model tests: tiny random-weight Llamas (GQA, and MHA with an untied LM head),
and transformers' own load of the default GGUF (once per session: it takes ~30 s)."""
from __future__ import annotations

import pytest

from tests.conftest import build_tiny_llama


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("gqa"), vocab_size=384, num_attention_heads=4,
                            num_key_value_heads=2)


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("mha"), vocab_size=384, num_attention_heads=4,
                            num_key_value_heads=4, tie_word_embeddings=False, seed=3)


@pytest.fixture(scope="session")
def default_hf(default_gguf):
    """transformers' LlamaForCausalLM of the default GGUF (its own dequantization), fp32."""
    from tests.model.parity import hf_gguf_model
    return hf_gguf_model(str(default_gguf))
