"""Tokenizer on the default GGUF model: HF chat-template parity, one BOS (C23), eos ids, the on-disk cache."""
from __future__ import annotations

import json
import os

import pytest

from radixserve.errors import InvalidRequest
from radixserve.tokenizer.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What color is the sky on Mars?"}]
WITH_SYSTEM = [{"role": "system", "content": "You are a terse planetary scientist."}] + USER
MULTI_TURN = WITH_SYSTEM + [{"role": "assistant", "content": "Butterscotch."},
                            {"role": "user", "content": "And at sunset?"}]


@pytest.fixture(scope="module")
def gguf_path(default_gguf) -> str:
    return str(default_gguf)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module")
def fresh(gguf_path, cache_dir) -> Tokenizer:
    """Converted from the GGUF file by transformers (the reference), filling an empty cache."""
    return Tokenizer.load(gguf_path, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def tok(fresh, gguf_path, cache_dir) -> Tokenizer:
    """The same tokenizer loaded back from the cache, as every later process gets it."""
    return Tokenizer.load(gguf_path, cache_dir=cache_dir)


def hf_chat_ids(hf, messages, add_generation_prompt=True) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=True, return_dict=False))


def test_second_load_hits_cache_and_keeps_template(fresh, tok, cache_dir):
    assert not fresh.loaded_from_cache and tok.loaded_from_cache
    assert len(os.listdir(cache_dir)) == 1
    assert tok.hf.chat_template == fresh.hf.chat_template and "<|im_start|>" in tok.hf.chat_template
    assert tok.eos_token_ids == fresh.eos_token_ids
    text = "Mixed: 中文, emoji 👍🏽, code `x = 1`\n"
    assert tok.encode(text) == fresh.encode(text)


@pytest.mark.parametrize("messages", [USER, WITH_SYSTEM, MULTI_TURN], ids=["user", "system", "multi-turn"])
def test_chat_ids_equal_hf_reference(fresh, tok, messages):
    ids = tok.apply_chat_template(messages)
    assert ids == hf_chat_ids(fresh.hf, messages)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
        hf_chat_ids(fresh.hf, messages, add_generation_prompt=False)


def test_system_message_present_and_header_once(tok):
    """C23 (c): the system message replaces the default one and the assistant header comes once."""
    plain, system = tok.apply_chat_template(USER), tok.apply_chat_template(WITH_SYSTEM)
    assert "You are a terse planetary scientist." in tok.decode(system, skip_special_tokens=False)
    assert "SmolLM" in tok.decode(plain) and "SmolLM" not in tok.decode(system)
    header = tok.encode("<|im_start|>assistant\n")
    for ids in (plain, system):
        assert ids[-len(header):] == header
        assert tok.decode(ids, skip_special_tokens=False).count("<|im_start|>assistant") == 1


@pytest.mark.parametrize("messages", [USER, WITH_SYSTEM])
def test_exactly_one_bos_in_chat_and_in_pre_rendered_completions(tok, messages):
    """C23 (a, b): pre-rendered template text sent as a completions prompt gives the chat ids."""
    ids = tok.apply_chat_template(messages)
    rendered = tok.render_chat(messages)
    assert tok.encode(rendered) == ids
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == rendered.count(tok.hf.bos_token)


def test_bos_adding_tokenizer_gets_no_second_bos(tok, tmp_path):
    """C23 with a tokenizer that adds BOS itself (SmolLM2's vocabulary plus a BOS post-processor)."""
    tok.hf.save_pretrained(tmp_path)
    spec_path = tmp_path / "tokenizer.json"
    spec = json.loads(spec_path.read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq, seq],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                  "tokens": ["<|im_start|>"]}}}
    spec_path.write_text(json.dumps(spec))
    bos_tok = Tokenizer.load(str(tmp_path))
    assert bos_tok.encode("hello") == [1] + tok.encode("hello")           # BOS is added ...
    rendered = bos_tok.render_chat(USER)
    assert bos_tok.hf.encode(rendered)[:2] == [1, 1]                      # ... HF would double it ...
    assert bos_tok.encode(rendered) == tok.apply_chat_template(USER)      # ... we do not
    assert bos_tok.apply_chat_template(USER) == hf_chat_ids(bos_tok.hf, USER) == tok.apply_chat_template(USER)


def test_ids_and_eos(tok, gguf_path):
    """eos = GGUF tokenizer.ggml.eos_token_id (what HF generate stops on) = the template's turn end."""
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == frozenset({im_end}) == frozenset({2})
    assert tok.bos_token_id == tok.hf.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.vocab_size == 49152
    assert tok.byte_token_ids == frozenset()   # byte-level BPE: no byte-fallback tokens
    assert {0, 1, 2} <= tok.special_token_ids


def test_decode_round_trip(tok):
    text = "  Leading spaces, 中文, emoji 👨‍👩‍👧‍👦 and\n\tcode.  "
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 28120, 2]) == "hello"
    assert tok.decode([1, 28120, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


@pytest.mark.parametrize("messages", [
    [], "hello", None, [{"content": "no role"}], ["not a dict"], [{"role": "", "content": "x"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}],
])
def test_bad_messages_raise_invalid_request(tok, messages):
    with pytest.raises(InvalidRequest) as err:
        tok.apply_chat_template(messages)
    assert err.value.status == 400 and err.value.param == "messages"


def test_text_parts_and_empty_content(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What color is "},
                                          {"type": "text", "text": "the sky on Mars?"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(USER)
    empty = tok.apply_chat_template([{"role": "user", "content": ""}])
    assert empty[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]
