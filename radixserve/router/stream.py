"""A relayed SSE stream as the router reads it: whole events, where content starts, and what a continuation resends (docs/stream_migration.md)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from radixserve.errors import error_body

DONE = b"data: [DONE]\n\n"
CHAT_PATH = "/v1/chat/completions"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events, each with its closing blank line, from a body's raw chunks. A transport
    error propagates and drops the event it cut; bytes after the last blank line at a clean end
    come out as one last event (closed)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while (cut := buf.find(b"\n\n")) >= 0:
            yield buf[:cut + 2]
            buf = buf[cut + 2:]
    if buf.strip():
        yield buf.rstrip(b"\n") + b"\n\n"


def payload(event: bytes) -> Any:
    """The JSON of a `data:` event; None for [DONE], comments and anything that is not JSON."""
    if not event.startswith(b"data:"):
        return None
    try:
        return json.loads(event[len(b"data:"):])
    except (ValueError, RecursionError):
        return None


def error_of(event: bytes) -> dict | None:
    """The error of an SSE error event (`data: {"error": {...}}`), else None."""
    data = payload(event)
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else None


def error_event(message: str) -> bytes:
    """A router-made `worker_error` event (502) that ends a stream no worker could finish."""
    return b"data: " + json.dumps(error_body(message, "worker_error", 502)).encode() + b"\n\n"


def _is_role_only(data: Any) -> bool:
    """A chat chunk whose choices carry only the assistant role (the first of a stream)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    return bool(choices) and all(
        isinstance(c, dict) and c.get("finish_reason") is None and c.get("logprobs") is None
        and c.get("delta") == {"role": "assistant", "content": ""} for c in choices)


def _is_blank(choice: dict) -> bool:
    """A choice that says nothing once its token ids are gone (the worker sent it for them)."""
    return (not choice.get("text") and choice.get("delta", {}) in ({}, {"content": ""})
            and choice.get("logprobs") is None and choice.get("finish_reason") is None)


class StreamLedger:
    """What the client of one streamed request has been sent, so that another worker can
    continue it (stream migration).

    `migratable`: the stream can be continued at all: migration is on, the request has one
    choice (n = 1, one prompt). Then the router asks the worker for each chunk's token ids
    (`return_token_ids`), counts those that reach the client, takes them out again unless the
    client asked for them, and gives a continuation's chunks the first response id and
    created time. A continuation is the same request plus `resume_token_ids` (the worker
    replays them, server/resume.py), so greedy output equals an uncut run's, and its usage
    counts the original prompt and every completion token once.

    Events from a worker pass `relay()` in order; `committed` turns true with the first event
    that is neither an error nor a chat role-only chunk (role chunks wait for it, so a worker
    that fails before any content can be retried as if nothing had been sent).
    """

    def __init__(self, path: str, body: bytes, migrate: bool):
        self.chat = path == CHAT_PATH
        self.raw = body
        self.fields: dict = json.loads(body)
        n, prompt = self.fields.get("n", 1), self.fields.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        self.migratable = migrate and n in (None, 1) and not batch
        self.strip_ids = self.migratable and self.fields.get("return_token_ids") is not True
        self.token_ids: list[int] = []   # delivered to the client, in order
        self.response_id: Any = None
        self.created: Any = None
        self.role_sent = False
        self.committed = False
        self.finished = False            # the choice's finish_reason reached the client

    def first_body(self) -> bytes:
        """The body of the first attempts: the client's, asking for token ids if migratable."""
        if not self.migratable or not self.strip_ids:
            return self.raw
        return json.dumps({**self.fields, "return_token_ids": True}).encode()

    def continuation_body(self) -> bytes:
        """The body that continues the stream after what the client has: the request plus
        resume_token_ids (the client's own, if any, then the delivered tokens)."""
        resumed = list(self.fields.get("resume_token_ids") or []) + self.token_ids
        return json.dumps({**self.fields, "return_token_ids": True,
                           "resume_token_ids": resumed}).encode()

    def can_continue(self) -> bool:
        """Whether a cut stream can be continued: migratable, and its choice not finished."""
        return self.migratable and not self.finished

    def is_held(self, event: bytes) -> bool:
        """Whether `event` is a chat role-only chunk (held until content comes; dropped when the
        client has its role chunk already)."""
        return self.chat and _is_role_only(payload(event))

    def relay(self, event: bytes) -> bytes | None:
        """The bytes of `event` for the client (None: nothing to send), counting what it
        delivers. Events of a stream that cannot migrate pass unchanged."""
        self.committed = self.committed or not self.is_held(event)
        if not self.migratable:
            return event
        data = payload(event)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            return event
        if _is_role_only(data):
            if self.role_sent:
                return None
            self.role_sent = True
        if self.response_id is None:
            self.response_id, self.created = data.get("id"), data.get("created")
        data["id"], data["created"] = self.response_id, self.created
        blank = bool(data["choices"])
        for choice in data["choices"]:
            if not isinstance(choice, dict):
                return event
            ids = choice.pop("token_ids", None) if self.strip_ids else choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids.extend(ids)
            self.finished = self.finished or choice.get("finish_reason") is not None
            blank = blank and self.strip_ids and ids is not None and _is_blank(choice)
        if blank:
            return None
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
