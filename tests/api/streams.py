"""Helpers that read OpenAI streams and check their framing (field cases C13-C17)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    """A stream folded per choice index, with what the framing checks need."""

    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, list[str]] = field(default_factory=dict)      # finish reasons seen per index
    roles: dict[int, int] = field(default_factory=dict)             # role deltas per index
    content_after_finish: list[int] = field(default_factory=list)
    usage: dict | None = None
    usage_before_finish: bool = False
    num_done: int = 0
    chunks: list[dict] = field(default_factory=list)


def fold(chunks: list[dict], chat: bool) -> StreamResult:
    res = StreamResult(chunks=chunks)
    for chunk in chunks:
        if chunk.get("usage"):
            res.usage = chunk["usage"]
            assert chunk["choices"] == [], "usage chunk must carry no choices"
            continue
        for choice in chunk["choices"]:
            i = choice["index"]
            if chat:
                delta = choice["delta"]
                if "role" in delta:
                    res.roles[i] = res.roles.get(i, 0) + 1
                text = delta.get("content") or ""
            else:
                text = choice["text"]
            if text and i in res.finish:
                res.content_after_finish.append(i)
            res.texts[i] = res.texts.get(i, "") + text
            if choice["finish_reason"] is not None:
                res.finish.setdefault(i, []).append(choice["finish_reason"])
    return res


def post_stream(http: httpx.Client, path: str, body: dict) -> StreamResult:
    """POST with stream: true and parse the raw SSE, checking `data: [DONE]` comes last, once."""
    chunks, num_done = [], 0
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                num_done += 1
                continue
            assert num_done == 0, "event after [DONE]"
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            chunks.append(chunk)
    res = fold(chunks, chat="chat" in path)
    res.num_done = num_done
    return res


def assert_framing(res: StreamResult, n: int, chat: bool, usage: bool) -> None:
    """C17: one finish chunk per index after its last content, one role delta per index (chat),
    [DONE] exactly once, the usage chunk (when asked for) after every finish chunk."""
    assert res.num_done == 1
    assert sorted(res.finish) == list(range(n)), res.finish
    assert all(len(v) == 1 for v in res.finish.values()), res.finish
    assert not res.content_after_finish
    if chat:
        assert res.roles == {i: 1 for i in range(n)}
    if usage:
        assert res.usage is not None and res.chunks[-1].get("usage") == res.usage
    else:
        assert res.usage is None
