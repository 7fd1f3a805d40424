"""Canned tool-call replies in each model format (field case C43) and helpers that parse them chunked and whole."""
from __future__ import annotations

import json

from radixserve.parsers.chat_output import ChatOutputParser
from radixserve.parsers.events import CallArgs, CallStart, Event, ParsedMessage
from radixserve.parsers.schema import ToolSpec
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer

TOOLS = {
    "calc": ToolSpec("calc", {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
        "none": {"type": "null"}, "maybe": {"type": ["integer", "null"]},
        "text": {"type": "string"}, "opts": {"type": "object"},
        "items": {"type": "array", "items": {"type": "integer"}}}}),
    "get_time": ToolSpec("get_time"),
    "search": ToolSpec("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
}
CHUNKS = (1, 2, 3, 8)
# Quotes, a backslash, a newline, unicode, and tags that close nothing here: "</arg_value>" and
# "</parameter>" not followed by another argument or the end of the call, "</tool_call>",
# "</function>", "<arg_key>" and "<parameter=" inside.
TRICKY = ('He said "hi" \\ then\nleft: naïve 日本 🎉 </arg_value> x </tool_call> <arg_key> done'
          ' </parameter> y </function> <parameter= z')


def glm45(name: str, args: list[tuple[str, str]]) -> str:
    """A GLM-4.5/4.6 call: newlines between the tags."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args)
    return f"<tool_call>{name}\n{body}</tool_call>"


def glm47(name: str, args: list[tuple[str, str]]) -> str:
    """A GLM-4.7 call: the same tags without newlines."""
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args)
    return f"<tool_call>{name}{body}</tool_call>"


def qwen3_coder(name: str, args: list[tuple[str, str]]) -> str:
    """A Qwen3-Coder call: a newline around every tag and value, as its chat template writes."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def qwen(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def parse(parser: str, pieces: list[str], reasoning: bool = False,
          starts_in_reasoning: bool = False, tools: dict | None = None) -> tuple[ParsedMessage, list[list[Event]]]:
    """Feed `pieces` one by one, then finish; the folded message and each feed's events
    (`tools`: the offered functions, default TOOLS)."""
    p = ChatOutputParser(parser, TOOLS if tools is None else tools, reasoning=reasoning,
                         starts_in_reasoning=starts_in_reasoning)
    per_feed = [p.feed(piece) for piece in pieces] + [p.finish()]
    message = ParsedMessage()
    for events in per_feed:
        message.add(events)
    return message, per_feed


def char_chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def token_chunks(tokenizer, text: str, size: int) -> list[str]:
    """`text` as the server streams it: encoded, then detokenized `size` tokens at a time."""
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    pieces = [detok.add(ids[i:i + size]) for i in range(0, len(ids), size)]
    pieces.append(detok.finish())
    assert "".join(pieces) == text, "the tokenizer does not round-trip this text"
    return pieces


def calls_json(message: ParsedMessage) -> list[tuple[str, dict]]:
    """(name, parsed arguments) per call; every arguments text must be one JSON object."""
    out = []
    for call in message.calls:
        args = json.loads(call.arguments)
        assert isinstance(args, dict), call.arguments
        out.append((call.name, args))
    return out


def assert_stream_shape(per_feed: list[list[Event]]) -> None:
    """Each call starts once, in index order, before any of its argument fragments; call ids
    are distinct."""
    started: list[str] = []
    for events in per_feed:
        for ev in events:
            if isinstance(ev, CallStart):
                assert ev.index == len(started), "call started twice or out of order"
                started.append(ev.call_id)
            elif isinstance(ev, CallArgs):
                assert ev.index < len(started), "arguments before their call started"
    assert len(set(started)) == len(started), "call ids repeat"


def same_message(a: ParsedMessage, b: ParsedMessage) -> bool:
    """Equal but for call ids (random per call)."""
    strip = [(c.name, c.arguments) for c in a.calls], [(c.name, c.arguments) for c in b.calls]
    return (a.content, a.reasoning) == (b.content, b.reasoning) and strip[0] == strip[1]
