"""Tool-call parsers (GLM-4.5/4.7, Qwen2.5, Qwen3-Coder, generic JSON): every C43 case, streamed at 1, 2, 3 and 8 tokens and characters per chunk, equals the whole reply parsed at once."""
from __future__ import annotations

import json

import pytest

from radixserve.parsers.events import CallArgs
from radixserve.parsers.schema import ToolSpec
from tests.unit.parser_cases import (CHUNKS, TRICKY, assert_stream_shape, calls_json, char_chunks,
                                     glm45, glm47, parse, qwen, qwen3_coder, same_message,
                                     token_chunks)

# case -> (GLM / Qwen3-Coder arguments as text, the typed arguments expected)
ARGS = {
    "scalars": ([("n", "42"), ("x", "-2.5e3"), ("ok", "true"), ("none", "null"), ("maybe", "null")],
                {"n": 42, "x": -2500.0, "ok": True, "none": None, "maybe": None}),
    "strings": ([("text", TRICKY)], {"text": TRICKY}),
    "nested_object_last": ([("n", "1"), ("opts", '{"a": {"b": [1, {"c": null}]}, "d": "}"}')],
                           {"n": 1, "opts": {"a": {"b": [1, {"c": None}]}, "d": "}"}}),
    "array": ([("items", "[1, 2, 3]")], {"items": [1, 2, 3]}),
    "no_arguments": ([], {}),
    "wrong_type_kept_as_text": ([("n", "forty")], {"n": "forty"}),
    "unknown_parameter_read_as_json": ([("extra", "[true]"), ("word", "plain")],
                                       {"extra": [True], "word": "plain"}),
    # whitespace around a value is not part of it (vLLM strips it; xgrammar pads with it)
    "padded_values": ([("text", "\u3000\n  two  words \u00a0\n"), ("n", " 7\n")], {"text": "two  words", "n": 7}),
}
NAMES = {"no_arguments": "get_time"}


def replies(fmt: str) -> dict[str, tuple[str, list, str]]:
    """case -> (reply text, [(name, arguments)], content) in format `fmt`."""
    def call(name: str, case: str) -> str:
        text_args, typed = ARGS[case]
        if fmt == "qwen25":
            return qwen(name, typed)
        return {"glm45": glm45, "glm47": glm47, "qwen3_coder": qwen3_coder}[fmt](name, text_args)

    out = {case: (call(NAMES.get(case, "calc"), case), [(NAMES.get(case, "calc"), typed)], "")
           for case, (_, typed) in ARGS.items()}
    two = call("calc", "scalars") + "\n" + call("get_time", "no_arguments")
    out["two_calls_in_a_row"] = (two, [("calc", ARGS["scalars"][1]), ("get_time", {})], "")
    around = "Let me check.\n\n" + call("calc", "array") + "\nDone, see above."
    out["text_around_a_call"] = (around, [("calc", {"items": [1, 2, 3]})],
                                 "Let me check.Done, see above.")
    return out


FORMATS = ("glm45", "glm47", "qwen25", "qwen3_coder")
CASES = [(fmt, case) for fmt in FORMATS for case in replies(fmt)]


@pytest.mark.parametrize("fmt, case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_c43_case_streamed_equals_whole(fmt, case, default_tokenizer):
    text, expected_calls, content = replies(fmt)[case]
    parser = "glm45" if fmt == "glm47" else fmt
    whole, _ = parse(parser, [text])
    assert calls_json(whole) == expected_calls
    assert whole.content == content and whole.reasoning == ""
    for size in CHUNKS:
        for pieces in (char_chunks(text, size), token_chunks(default_tokenizer, text, size)):
            streamed, per_feed = parse(parser, pieces)
            assert_stream_shape(per_feed)
            assert same_message(streamed, whole), (size, pieces)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reasoning_then_a_call(fmt, default_tokenizer):
    text, expected_calls, _ = replies(fmt)["scalars"]
    reply = "<think>\nThe user wants numbers.\n</think>\n\nSure." + text
    whole, _ = parse("glm45" if fmt == "glm47" else fmt, [reply], reasoning=True)
    assert (whole.reasoning, whole.content) == ("The user wants numbers.", "Sure.")
    assert calls_json(whole) == expected_calls
    for size in CHUNKS:
        streamed, per_feed = parse("glm45" if fmt == "glm47" else fmt,
                                   token_chunks(default_tokenizer, reply, size), reasoning=True)
        assert_stream_shape(per_feed)
        assert same_message(streamed, whole)


def test_glm_string_argument_streams_as_it_is_generated():
    """A string parameter's characters go out before its closing tag arrives."""
    _, per_feed = parse("glm45", ["<tool_call>search\n<arg_key>query</arg_key><arg_value>",
                                  "weather in", " Paris", "</arg_value></tool_call>"])
    fragments = ["".join(e.text for e in events if isinstance(e, CallArgs)) for events in per_feed]
    assert fragments == ['{"query": "', "weather in", " Paris", '"}', ""]


MALFORMED = {
    "glm45": ["<tool_call>unknown_fn\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
              "<tool_call>\n</tool_call>", "<tool_call>" + "x" * 300,
              "<tool_call>calc"],   # the reply ends before the name does
    "qwen3_coder": ["<tool_call>\n<function=unknown_fn>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n</tool_call>", "<tool_call>\n<function=" + "x" * 300,
                    "<tool_call>\n<function=calc",   # the reply ends before the name does
                    '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'],   # Qwen2.5's JSON
    "qwen25": ['<tool_call>\n{"name": "calc", "arguments": {"n": }}\n</tool_call>',
               '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>',
               "<tool_call>\nnot json at all\n</tool_call>",
               '<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>',
               '<tool_call>\n{"name": "calc", "arguments": {"n": 1}'],
}


@pytest.mark.parametrize("fmt, text", [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_are_returned_as_text(fmt, text):
    reply = "Before. " + text
    for size in CHUNKS + (len(reply),):
        message, _ = parse(fmt, char_chunks(reply, size))
        assert message.calls == [] and message.content == reply, size


def test_qwen_without_closing_tag_and_with_string_arguments():
    lenient = ('<tool_call>\n{"name": "calc", "arguments": "{\\"n\\": \\"7\\"}"}\n</tool_call>'
               '<tool_call>{"arguments": {"x": 1}, "name": "calc"}')
    message, _ = parse("qwen25", char_chunks(lenient, 3))
    assert calls_json(message) == [("calc", {"n": 7}), ("calc", {"x": 1})]


def test_qwen3_coder_string_argument_streams_and_a_cut_call_closes():
    """As GLM: a string parameter streams before its closing tag; a call the reply ends
    inside keeps what was read, its JSON closed."""
    _, per_feed = parse("qwen3_coder", ["<tool_call>\n<function=search>\n<parameter=query>\n",
                                        "weather in", " Paris", "\n</parameter>\n</function>\n</tool_call>"])
    fragments = ["".join(e.text for e in events if isinstance(e, CallArgs)) for events in per_feed]
    assert "".join(fragments) == '{"query": "weather in Paris"}'
    assert fragments[1:3] == ["weather in", " Paris"]
    text = "<tool_call>\n<function=calc>\n<parameter=n>\n5\n</parameter>\n<parameter=text>\nhalf a sen"
    for size in CHUNKS:
        message, per_feed = parse("qwen3_coder", char_chunks(text, size))
        assert_stream_shape(per_feed)
        assert calls_json(message) == [("calc", {"n": 5, "text": "half a sen"})], size


def test_glm_call_cut_short_is_closed_as_valid_json():
    """A committed call the reply ends inside (max_tokens) keeps what was read; the JSON is
    always closed, a string argument included."""
    for text, args in (("<tool_call>calc\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>",
                        {"n": 5}),
                       ("<tool_call>calc\n<arg_key>text</arg_key>\n<arg_value>half a sen",
                        {"text": "half a sen"}),
                       ("<tool_call>calc\n<arg_key>te", {})):
        for size in CHUNKS:
            message, per_feed = parse("glm45", char_chunks(text, size))
            assert_stream_shape(per_feed)
            assert calls_json(message) == [("calc", args)], (text, size)


@pytest.mark.parametrize("reply, calls, content", [
    ('{"name": "calc", "arguments": {"n": 1}}', [("calc", {"n": 1})], ""),
    (' [{"name": "calc", "parameters": {"n": "2"}}, {"name": "get_time"}] Done.',
     [("calc", {"n": 2}), ("get_time", {})], "Done."),
    ('{"name": "calc", "arguments": {}}\n{"name": "get_time", "arguments": {}}',
     [("calc", {}), ("get_time", {})], ""),
    ('{"answer": 42}', [], '{"answer": 42}'),
    ('[1, 2]', [], '[1, 2]'),
    ('Plain text {"name": "calc"}', [], 'Plain text {"name": "calc"}'),
    ('{"name": "calc", "arguments": {"n": 1}', [], '{"name": "calc", "arguments": {"n": 1}'),
])
def test_generic_json_format(reply, calls, content):
    whole, _ = parse("json", [reply])
    assert calls_json(whole) == calls and whole.content == content
    for size in CHUNKS:
        streamed, per_feed = parse("json", char_chunks(reply, size))
        assert_stream_shape(per_feed)
        assert same_message(streamed, whole)


def test_glm_long_names_and_keys_stream_as_they_parse_whole():
    """A 250-character name (256 may be offered) and a 300-character key are read streamed as
    whole; a key over the parser's limit ends the call as text, streamed or not."""
    name, key = "f" * 250, "k" * 300
    tools = {name: ToolSpec(name, {"type": "object", "properties": {key: {"type": "string"}}})}
    for text, calls in ((glm45(name, [(key, "v")]), [(name, {key: "v"})]),
                        (glm45(name, [("k" * 5000, "v")]), None)):
        whole, _ = parse("glm45", [text], tools=tools)
        assert calls is None or calls_json(whole) == calls
        for size in (1, 7, 64):
            streamed, _ = parse("glm45", char_chunks(text, size), tools=tools)
            assert same_message(streamed, whole), size


def test_whitespace_and_text_without_calls_pass_through_unchanged():
    for fmt in ("glm45", "qwen25", "qwen3_coder", "json"):
        reply = "  Hello,\n  world <tool_call is not a tag>  \n\n"
        for size in CHUNKS:
            message, _ = parse(fmt, char_chunks(reply, size))
            assert message.calls == [] and message.content == reply, (fmt, size)


def test_arguments_are_compact_json_the_same_in_every_format():
    glm, _ = parse("glm45", [glm45("calc", ARGS["scalars"][0])])
    qw, _ = parse("qwen25", [qwen("calc", ARGS["scalars"][1])])
    assert glm.calls[0].arguments == qw.calls[0].arguments == json.dumps(ARGS["scalars"][1])


@pytest.mark.parametrize("fmt", ["glm45", "qwen3_coder"])
def test_values_json_cannot_hold_stay_text(fmt):
    """An overflowing number (json.loads reads 1e999 as inf, which JSON cannot write) or nesting
    too deep for the JSON reader: the value stays text, never an exception."""
    call = glm45 if fmt == "glm45" else qwen3_coder
    deep = "[" * 100_000 + "]" * 100_000
    for name, key, raw, want in (("get_time", "z", "1e999", "1e999"), ("calc", "opts", '{"a": -1e400}', '{"a": -1e400}'),
                                 ("calc", "items", deep, deep)):
        text = call(name, [(key, raw)])
        for pieces in ([text], char_chunks(text, 4096)):
            message, _ = parse(fmt, pieces)
            assert calls_json(message) == [(name, {key: want})]


def test_a_json_call_holding_an_overflowing_number_is_text():
    text = '<tool_call>\n{"name": "calc", "arguments": {"x": 1e999}}\n</tool_call>'
    message, _ = parse("qwen25", [text])
    assert message.calls == [] and message.content == text


@pytest.mark.parametrize("fmt", ["glm45", "qwen3_coder"])
def test_whitespace_around_names_and_between_tags_reads_alike_at_any_chunking(fmt):
    """Padding inside the name's tag within the bound is a call, beyond it text, streamed as
    whole; long whitespace runs between tags are read the same at any chunking."""
    pad = "\n" if fmt == "glm45" else ""
    texts = {"qwen3_coder": ["<tool_call>\n<function=search" + " " * 100 + ">\n</function>\n</tool_call>",
                             "<tool_call>\n<function=search" + " " * 300 + ">\n</function>\n</tool_call>",
                             "<tool_call>\n<function=" + " " * 300 + "search>\n</function>\n</tool_call>",
                             "<tool_call>" + "\n" * 20_000 + "<function=search>\n</function>\n</tool_call>",
                             "<tool_call>\n<function=search>" + "\n" * 20_000 + "</function>" + "\n" * 20_000
                             + "</tool_call>"],
             "glm45": ["<tool_call>search" + " " * 100 + pad + "</tool_call>",
                       "<tool_call>search" + " " * 300 + pad + "</tool_call>",
                       "<tool_call>search" + "\n" * 20_000 + "</tool_call>"]}[fmt]
    for text in texts:
        whole, _ = parse(fmt, [text])
        for size in (1, 2, 50):
            streamed, _ = parse(fmt, char_chunks(text, size))
            assert same_message(streamed, whole), (text[:40], size)
    assert [len(parse(fmt, [t])[0].calls) for t in texts[:2]] == [1, 0]


@pytest.mark.parametrize("fmt", ["glm45", "qwen3_coder"])
def test_a_repeated_argument_keeps_its_first_value(fmt):
    call = glm45 if fmt == "glm45" else qwen3_coder
    text = call("calc", [("n", "1"), ("text", "a"), ("n", "2"), ("text", "b"), ("x", "2.5")])
    for size in CHUNKS:
        message, _ = parse(fmt, char_chunks(text, size))
        assert message.calls[0].arguments == '{"n": 1, "text": "a", "x": 2.5}', size
