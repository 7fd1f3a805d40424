"""Helpers for tool-call API tests: servers with output parsers and fault injection, replies forced with sampler.force_tokens, streamed tool calls folded."""
from __future__ import annotations

import json
import pathlib
import shutil

from tests.api.conftest import TINY_CONTEXT, start_tiny_server
from tests.api.streams import StreamResult, post_stream

# A Qwen3-like template that renders what the tool flow sends: tools, assistant tool calls
# (arguments re-encoded with tojson, so a JSON string would show up quoted twice), tool results
# with their call ids, and an opened <think> block when enable_thinking is set.
QWEN_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""

SERVER_FLAGS = ["--context-length", str(TINY_CONTEXT), "--max-total-tokens", "16384",
                "--page-size", "16", "--enable-debug-endpoints", "--enable-fault-injection"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def start_parser_server(request, parsers: list[str], model_dir: pathlib.Path | None = None):
    """A tiny-model server with fault injection and the given parser flags."""
    args = [*SERVER_FLAGS, *parsers]
    if model_dir is None:
        return start_tiny_server(request, args)
    from tests.api.conftest import ServerProcess
    return ServerProcess(["--model-path", str(model_dir), *args]).wait_ready()


def parser_server(request, parsers: list[str], model_dir: pathlib.Path | None = None):
    """Fixture body: a parser server, checked for leaks and tracebacks when the module is done."""
    server = start_parser_server(request, parsers, model_dir)
    yield server
    try:
        server.assert_no_leak()
        server.assert_no_tracebacks()
    finally:
        server.stop()


def qwen_like_model_dir(tiny_model_dir: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A copy of the tiny model whose tokenizer carries QWEN_LIKE_TEMPLATE."""
    from transformers import AutoTokenizer
    shutil.copytree(tiny_model_dir, target)
    hf = AutoTokenizer.from_pretrained(target, local_files_only=True)
    hf.chat_template = QWEN_LIKE_TEMPLATE
    hf.save_pretrained(target)
    return target


def force(server, tokenizer, text: str, count: int = 1, end: str = "<|im_end|>") -> int:
    """The next `count` requests emit `text` (in the tokenizer's ids) and then `end` (an eos);
    returns the number of tokens each will have generated."""
    ids = [*tokenizer.hf.encode(text, add_special_tokens=False),
           tokenizer.hf.convert_tokens_to_ids(end)]
    assert tokenizer.decode(ids[:-1]) == text, "canned text does not round-trip"
    r = server.post("/admin/fault", json={"kind": "sampler.force_tokens", "token_ids": ids,
                                          "count": count})
    assert r.status_code == 200, r.text
    return len(ids)


def chat(server, **fields) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 200, **fields}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **fields) -> StreamResult:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 200, "stream_options": {"include_usage": True}, **fields}
    return post_stream(server.http, "/v1/chat/completions", body)


def streamed_message(res: StreamResult, index: int = 0) -> dict:
    """Choice `index` of a stream folded as a message; checks that each call's id, type and
    name come once, on its first delta, with the right index, before its arguments."""
    content, reasoning, calls = "", "", []
    for chunk in res.chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for entry in delta.get("tool_calls") or []:
                if entry["index"] == len(calls):
                    assert entry["type"] == "function" and entry["id"].startswith("call_")
                    calls.append({"id": entry["id"], "name": entry["function"]["name"],
                                  "arguments": ""})
                else:
                    assert entry["index"] == len(calls) - 1, "fragment for another call"
                    assert set(entry) == {"index", "function"}
                    assert set(entry["function"]) == {"arguments"}, "name sent twice"
                calls[-1]["arguments"] += entry["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": calls,
            "finish_reason": res.finish[index][0]}


def full_message(body: dict, index: int = 0) -> dict:
    choice = body["choices"][index]
    msg = choice["message"]
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in msg["tool_calls"] or []]
    assert all(c["type"] == "function" for c in msg["tool_calls"] or [])
    return {"content": msg["content"] or "", "reasoning": msg["reasoning_content"] or "",
            "calls": calls, "finish_reason": choice["finish_reason"]}


def same_reply(streamed: dict, full: dict) -> None:
    """Stream and full response say the same (call ids differ: one per call and response);
    each arguments text is one JSON object, equal as JSON and as text."""
    assert (streamed["content"], streamed["reasoning"], streamed["finish_reason"]) == \
        (full["content"], full["reasoning"], full["finish_reason"])
    assert [c["name"] for c in streamed["calls"]] == [c["name"] for c in full["calls"]]
    for s, f in zip(streamed["calls"], full["calls"]):
        assert isinstance(json.loads(f["arguments"]), dict)
        assert json.loads(s["arguments"]) == json.loads(f["arguments"])
        assert s["arguments"] == f["arguments"]
