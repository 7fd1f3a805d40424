"""Reasoning split (<think> blocks, the three ways a reply opens) and, for any text at any chunking, the invariants every output parser keeps."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.parsers.reasoning import opens_thinking, reasoning_token_count
from tests.unit.parser_cases import (CHUNKS, assert_stream_shape, calls_json, char_chunks, glm45,
                                     parse, same_message, token_chunks)


@pytest.mark.parametrize("reply, starts_inside, reasoning, content", [
    ("<think>\nStep 1. Step 2.\n</think>\n\nThe answer is 4.", False, "Step 1. Step 2.",
     "The answer is 4."),
    ("\n<think>x</think>y", False, "x", "y"),
    ("Step 1.\n</think>\n\nThe answer is 4.", True, "Step 1.", "The answer is 4."),
    ("The answer is 4. No thinking here.", False, "", "The answer is 4. No thinking here."),
    ("  <thin but not a tag", False, "", "  <thin but not a tag"),
    ("<think>cut off while thinking", False, "cut off while thinking", ""),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("<think></think>Direct answer.", False, "", "Direct answer."),
    ("<think>a < b and </thin> is not the end</think>ok", False,
     "a < b and </thin> is not the end", "ok"),
    ("", False, "", ""),
])
def test_reasoning_split(reply, starts_inside, reasoning, content, default_tokenizer):
    whole, _ = parse(None, [reply], reasoning=True, starts_in_reasoning=starts_inside)
    assert (whole.reasoning, whole.content, whole.calls) == (reasoning, content, [])
    for size in CHUNKS:
        pieces = [char_chunks(reply, size)]
        if reply:
            pieces.append(token_chunks(default_tokenizer, reply, size))
        for chunks in pieces:
            streamed, _ = parse(None, chunks, reasoning=True, starts_in_reasoning=starts_inside)
            assert same_message(streamed, whole), (size, chunks)


def test_without_a_reasoning_parser_think_tags_are_content():
    message, _ = parse(None, ["<think>x</think>y"])
    assert (message.reasoning, message.content) == ("", "<think>x</think>y")


def test_tool_call_inside_thinking_is_reasoning_text():
    call = glm45("calc", [("n", "1")])
    message, _ = parse("glm45", [f"<think>maybe {call}</think>{call}"], reasoning=True)
    assert message.reasoning == f"maybe {call}"
    assert calls_json(message) == [("calc", {"n": 1})]


@pytest.mark.parametrize("prompt_tail, expected", [
    ("<|im_start|>assistant\n<think>\n", True),        # Qwen3 thinking models
    ("<|assistant|><think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),   # thinking switched off
    ("<|assistant|>", False),
    ("<think>old</think> user text <think>x", False),
])
def test_opens_thinking(prompt_tail, expected):
    assert opens_thinking(prompt_tail) is expected


PIECES = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
          "<think>", "</think>", "calc", "get_time", "search", "n", "text", "query", "\n", " ", "1",
          "{", "}", "[", "]", '"', ":", ",", "\\", "true", "é", "🎉", '"name"', '"arguments"',
          '{"name": "calc", "arguments": {"n": 1}}', '{"name": "get_time"}',
          '<tool_call>\n{"name": "calc", "arguments": {"text": "a"}}', "\n</tool_call>",
          "<tool_call>calc\n<arg_key>text</arg_key><arg_value>", "</arg_value></tool_call>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.integers(0, 2**32 - 1),
       st.sampled_from(["glm45", "qwen25", "json", None]), st.booleans())
def test_any_text_at_any_chunking(parts, seed, parser, reasoning):
    """No parser raises; the chunked result equals the whole one; every call's arguments are
    one JSON object; calls start once, in order, before their arguments."""
    text = "".join(parts)
    whole, _ = parse(parser, [text], reasoning=reasoning)
    calls_json(whole)
    rng = random.Random(seed)
    ends = {sum(len(p) for p in parts[:i]) for i in range(1, len(parts))}   # piece boundaries
    ends |= {rng.randrange(len(text)) for _ in range(rng.randint(0, 8))} if text else set()
    cuts = sorted(e for e in ends if 0 < e < len(text) and rng.random() < 0.7)
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamed, per_feed = parse(parser, chunks, reasoning=reasoning)
    assert_stream_shape(per_feed)
    assert same_message(streamed, whole), chunks


@pytest.mark.parametrize("reply, starts_inside, thinking", [
    ("<think>\nIt is 4.\n</think>\n\nFour.", False, "<think>\nIt is 4.\n</think>"),
    ("  <think>a</think>b", False, "  <think>a</think>"),
    ("It is 4.</think>Four.", True, "It is 4.</think>"),
    ("<think>never closed", False, "<think>never closed"),
    ("Four. <think>late</think>", False, ""),              # not a reasoning block: content
    ("Four.", True, "Four."),                              # opened by the prompt, never closed
])
def test_reasoning_tokens_count_up_to_the_one_that_closes_the_block(reply, starts_inside, thinking,
                                                                   default_tokenizer):
    """usage's reasoning_tokens: the tokens of the reply up to and including the one that
    completes </think> (with the real tokenizer, where that boundary is a token boundary)."""
    hf = default_tokenizer.hf
    ids = hf.encode(reply, add_special_tokens=False)
    expected = len(hf.encode(thinking, add_special_tokens=False)) if thinking else 0
    assert ids[:expected] == hf.encode(thinking, add_special_tokens=False)   # boundary aligns
    decodes = []

    def decode(prefix):
        decodes.append(len(prefix))
        return default_tokenizer.decode(prefix)
    assert reasoning_token_count(ids, decode, starts_inside) == expected
    assert len(decodes) <= 2 + len(ids).bit_length()                 # a binary search


def test_reasoning_tokens_one_char_per_token():
    reply = "<think>abc</think>xyz"
    assert reasoning_token_count(list(range(len(reply))),
                                 lambda ids: "".join(reply[i] for i in ids)) == len("<think>abc</think>")
