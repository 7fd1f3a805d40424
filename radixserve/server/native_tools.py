"""Tool calls enforced in the model's own format: an xgrammar structural tag per --tool-call-parser.

    qwen25          <tool_call>\\n{"name": "f", "arguments": <JSON matching f's parameters>}\\n</tool_call>
    glm45, glm47    <tool_call>f <arg_key>k</arg_key><arg_value>v</arg_value>... </tool_call>   (glm_xml)
    qwen3_coder     <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>...\n</function>\n</tool_call>   (qwen_xml)

Unforced ("auto" + strict, as SGLang): free text, calls after the trigger; forced: only calls (docs/tool_calls.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.errors import InvalidRequest

TRIGGER = "<tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_WHITESPACE = 1   # per gap: free whitespace lets a weak model pad until max_tokens
# Text that ends an argument key in each XML format.
KEY_BREAKERS = {"glm45": "</arg_key>", "glm47": "</arg_key>", "qwen3_coder": ">"}


@dataclass(frozen=True)
class NativeCalls:
    """What one request's tag enforces; a None schema allows any object; `forced`: >= 1 call; `single`: <= 1."""

    parser: str
    functions: tuple[tuple[str, dict[str, Any] | None], ...]
    forced: bool
    single: bool

    def __post_init__(self) -> None:
        """InvalidRequest (400) for a property name holding KEY_BREAKERS[parser] or edge whitespace."""
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
        # As Qwen3-Coder's chat template: the content takes the newline after each parameter.
        return {"type": "tag", "begin": f"{TRIGGER}\n<function={name}>\n", "content": content,
                "end": "</function>\n</tool_call>"}
    content["style"] = "glm_xml"
    return {"type": "tag", "begin": TRIGGER + name, "content": content, "end": "</tool_call>"}


def _thinking(starts_in_reasoning: bool) -> list[dict[str, Any]]:
    """The rest of a prompt-opened thinking block, or an optional one; then up to two blanks ("</think>\n\n")."""
    gap = {"type": "regex", "pattern": r"[ \n]{0,2}"}
    if starts_in_reasoning:
        return [{"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}, gap]
    block = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    return [{"type": "optional", "content": {"type": "sequence", "elements": [block, gap]}}]


def native_calls_tag(calls: NativeCalls, reasoning: bool, starts_in_reasoning: bool) -> str:
    """The structural tag (JSON text) of `calls`."""
    tags = [_call_tag(calls.parser, name, schema) for name, schema in calls.functions]
    if not calls.forced:
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

