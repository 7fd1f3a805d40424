"""A relayed SSE stream as the router reads it: whole events, where content starts, and what a continuation resends (docs/stream_migration.md)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from radixserve.errors import error_body

DONE = b"data: [DONE]\n\n"
CHAT_PATH = "/v1/chat/completions"


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Per chunk, the whole SSE events it completes (never none), each with its closing blank line."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        events, start = [], 0
        while (cut := buf.find(b"\n\n", start)) >= 0:
            events.append(buf[start:cut + 2])
            start = cut + 2
        if events:
            buf = buf[start:]
            yield events
    if buf.strip():
        yield [buf.rstrip(b"\n") + b"\n\n"]


def payload(event: bytes) -> Any:
    """The JSON of a `data:` event; None for [DONE], comments and anything that is not JSON."""
    if not event.startswith(b"data:"):
        return None
    try:
        return json.loads(event[len(b"data:"):])
    except (ValueError, RecursionError):
        return None


def error_of(event: bytes) -> dict | None:
    return error_in(payload(event))


def error_in(data: Any) -> dict | None:
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else None


def error_event(message: str) -> bytes:
    """A `worker_error` event (502) that ends a stream no worker could finish."""
    return b"data: " + json.dumps(error_body(message, "worker_error", 502)).encode() + b"\n\n"


def _is_role_only(data: Any) -> bool:
    """A chat chunk whose choices carry only the assistant role (the first of a stream)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    return bool(choices) and all(
        isinstance(c, dict) and c.get("finish_reason") is None and c.get("logprobs") is None
        and c.get("delta") == {"role": "assistant", "content": ""} for c in choices)


def _is_abort_only(data: Any) -> bool:
    """Text-less chunk ending choices with finish_reason "abort": a worker's last before a stopped request's error."""
    choices = data.get("choices") if isinstance(data, dict) else None
    return bool(choices) and all(
        isinstance(c, dict) and c.get("finish_reason") == "abort" and not c.get("text")
        and not (c.get("delta") or {}).get("content") and not c.get("token_ids") for c in choices)


def _is_blank(choice: dict) -> bool:
    return (not choice.get("text") and choice.get("delta", {}) in ({}, {"content": ""})
            and choice.get("logprobs") is None and choice.get("finish_reason") is None)


class StreamLedger:
    """What one stream's client was sent, for another worker to continue (docs/stream_migration.md); events pass
    `relay()` in order, `committed` from the first not a held role chunk. Migratable: migration on, one choice."""

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
        self._parsed: tuple[bytes, Any] | None = None

    def first_body(self) -> bytes:
        if not self.migratable or not self.strip_ids:
            return self.raw
        return json.dumps({**self.fields, "return_token_ids": True}).encode()

    def continuation_body(self) -> bytes:
        """The request plus resume_token_ids: the client's own, then the delivered tokens."""
        resumed = list(self.fields.get("resume_token_ids") or []) + self.token_ids
        return json.dumps({**self.fields, "return_token_ids": True,
                           "resume_token_ids": resumed}).encode()

    def parse(self, event: bytes) -> Any:
        """payload(event), parsed once however often it is asked for (until relay() takes it)."""
        if self._parsed is None or self._parsed[0] is not event:
            self._parsed = (event, payload(event))
        return self._parsed[1]

    def can_continue(self) -> bool:
        return self.migratable and not self.finished

    def is_held(self, event: bytes) -> bool:
        """Read but not yet content: chat's role chunk, or an "abort" finish chunk (an error event
        may follow, and the request is then retried from its prompt as if nothing was sent)."""
        data = self.parse(event)
        return (self.chat and _is_role_only(data)) or _is_abort_only(data)

    def relay(self, event: bytes) -> bytes | None:
        """The bytes of `event` for the client (None: nothing), counting what it delivers."""
        self.committed = self.committed or not self.is_held(event)
        if not self.migratable:
            return event
        data, self._parsed = self.parse(event), None
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
