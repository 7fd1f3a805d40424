"""Fixtures of the model tests: tiny random-weight Llamas (GQA, and MHA with an untied LM head),
transformers' own load of the default GGUF and its greedy references (once per session: it takes ~30 s)."""
from __future__ import annotations

import random

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


@pytest.fixture(scope="session")
def default_case(default_tokenizer, default_hf):
    """The default model's parity prompts and transformers' greedy DEFAULT_NEW tokens for each (test_parity.py,
    test_speculative.py): (prompts, [(tokens, logits)])."""
    from tests.model.parity import DEFAULT_NEW, PARITY_TEXTS, hf_greedy_batch
    tok = default_tokenizer.hf   # transformers' conversion of the GGUF vocabulary (cached)
    rng = random.Random(1)
    # Five of the texts as they are (the lengths below cover the chunk and page boundaries).
    prompts = [tok.encode(t) for t in PARITY_TEXTS[::2]]
    # Longer prompts from concatenated text, past two 128-token chunks.
    corpus = " ".join(PARITY_TEXTS * 12)
    for n in [1, 5, 16, 17, 64, 129, 200, 257, 300, 140]:
        start = rng.randrange(0, 40)
        prompts.append(tok.encode(corpus)[start:start + n])
    return prompts, hf_greedy_batch(default_hf, prompts, DEFAULT_NEW)
