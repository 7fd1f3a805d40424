"""Tool calls enforced in the model's own format: an xgrammar structural tag per --tool-call-parser.

    parser          one call, as the tag enforces it (after the trigger `<tool_call>`)
    qwen25          <tool_call>\\n{"name": "f", "arguments": <JSON matching f's parameters>}\\n</tool_call>
    glm45, glm47    <tool_call>f <arg_key>k</arg_key><arg_value>v</arg_value>... </tool_call>
                    (xgrammar's `glm_xml` style: string values as text, others as JSON;
                    whitespace between the tags as either GLM version writes it)
    qwen3_coder     <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>...\n</function>\n</tool_call>
                    (xgrammar's `qwen_xml` style, laid out as Qwen3-Coder's chat template writes it)

Used in two cases (server/chat_tools.py):
- tool_choice "auto" with a tool whose `strict` is true (as SGLang does it): text stays free, but
  once the model writes `<tool_call>` the call must name an offered function, and a strict
  function's arguments must match its `parameters` (others: any JSON object);
- tool_choice "required" or a named function under `--tool-call-constraint native`: the reply
  is one or more calls (to the named function only, if one is named), at most a newline
  before each, with every function's arguments matching its schema, and then ends.
  No text comes before the first call, except a thinking block when a reasoning parser is on:
  one that the prompt already opened (`starts_in_reasoning`) must be closed, one that the model
  opens is optional.
parallel_tool_calls false allows one call. The tag travels as the
request's `structural_tag` (SamplingParams) and runner/structured.py compiles it (a 400 naming
`tools` when xgrammar refuses a schema); the reply is read back with the server's own parser.
Tag format: xgrammar's structural tag (docs: "Structural Tag", formats `triggered_tags`, `tag`,
`json_schema` with `style`, `sequence`, `optional`, `any_text`, `regex`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.parsers.chat_output import NATIVE_TOOL_FORMATS

TRIGGER = "<tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace characters allowed in one gap between JSON tokens or GLM tags: the formats need
# one (", ", ": ", a newline between tags); free whitespace lets a weak model pad until max_tokens.
MAX_WHITESPACE = 1
# Text an argument key cannot hold in each XML format (the key ends there): the grammar would
# let it through and the parser read another key.
KEY_BREAKERS = {"glm45": "</arg_key>", "glm47": "</arg_key>", "qwen3_coder": ">"}


@dataclass(frozen=True)
class NativeCalls:
    """What one request's tag enforces: `parser` (one of NATIVE_TOOL_FORMATS); `functions` as
    (name, arguments schema) pairs, the schema None where any JSON object will do; `forced`: at least
    one call ("required" or named); `single`: at most one call (parallel_tool_calls false)."""

    parser: str
    functions: tuple[tuple[str, dict[str, Any] | None], ...]
    forced: bool
    single: bool

    def __post_init__(self) -> None:
        """Raises InvalidRequest (param "tools") for an enforced property name the format's
        tags cannot carry: one containing KEY_BREAKERS[parser], or with whitespace around it
        (the parser strips a key)."""
        breaker = KEY_BREAKERS.get(self.parser)
        if breaker is None:
            return
        for name, schema in self.functions:
            properties = (schema or {}).get("properties")
            for key in properties if isinstance(properties, dict) else ():
                if breaker in key or key != key.strip():
                    raise InvalidRequest(
                        f"tools: the parameter name {key!r} of {name!r} cannot be written in the "
                        f"{self.parser} tool-call format (it contains {breaker!r} or whitespace at "
                        "an end), so the call cannot be enforced", param="tools")


def _call_tag(parser: str, name: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    content: dict[str, Any] = {"type": "json_schema", "json_schema": schema or ANY_OBJECT,
                               "max_whitespace_cnt": MAX_WHITESPACE}
    if parser == "qwen25":
        return {"type": "tag", "begin": f'{TRIGGER}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": content, "end": "}\n</tool_call>"}
    if parser == "qwen3_coder":
        content["style"] = "qwen_xml"
        # As Qwen3-Coder's chat template writes a call: a newline after each parameter, so a
        # call without arguments is "<function=f>\n</function>" (the content takes the newline).
        return {"type": "tag", "begin": f"{TRIGGER}\n<function={name}>\n", "content": content,
                "end": "</function>\n</tool_call>"}
    content["style"] = "glm_xml"
    return {"type": "tag", "begin": TRIGGER + name, "content": content, "end": "</tool_call>"}


def _thinking(starts_in_reasoning: bool) -> list[dict[str, Any]]:
    """Elements before the calls: the rest of a thinking block the prompt opened, or an
    optional one the model opens; each may be followed by up to two spaces or newlines
    (Qwen3 writes "</think>\n\n")."""
    gap = {"type": "regex", "pattern": r"[ \n]{0,2}"}
    if starts_in_reasoning:
        return [{"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}, gap]
    block = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    return [{"type": "optional", "content": {"type": "sequence", "elements": [block, gap]}}]


def native_calls_tag(calls: NativeCalls, reasoning: bool, starts_in_reasoning: bool) -> str:
    """The structural tag (JSON text) of `calls` (module doc). `reasoning`: a reasoning parser
    is on; `starts_in_reasoning`: the prompt ends inside a <think> block."""
    tags = [_call_tag(calls.parser, name, schema) for name, schema in calls.functions]
    if not calls.forced:   # free text; a call once the model writes the trigger
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags,
                               "at_least_one": False, "stop_after_first": calls.single}
        return json.dumps({"type": "structural_tag", "format": fmt})
    call = {"type": "or", "elements": tags}
    # one copy of the calls' schemas: (newline? call)+ rather than call (newline? call)*
    fmt = call if calls.single else {"type": "plus", "content": {
        "type": "sequence", "elements": [{"type": "regex", "pattern": r"\n?"}, call]}}
    if reasoning:
        fmt = {"type": "sequence", "elements": [*_thinking(starts_in_reasoning), fmt]}
    return json.dumps({"type": "structural_tag", "format": fmt})

