"""Where `radixserve chat` gets its replies: a running server over HTTP (SSE), or a model in this process."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import httpx

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0   # between two chunks of a stream (a long prefill)


class ChatError(Exception):
    """A failed turn or start, shown to the user as one line."""


@dataclass(frozen=True)
class Turn:
    """The conversation so far (OpenAI message dicts) and the sampling settings of one reply."""

    messages: list[dict]
    temperature: float
    max_tokens: int


class ChatBackend(Protocol):
    """`stream(turn)` yields text deltas; closing it early stops the generation; ChatError on failure."""

    def stream(self, turn: Turn) -> Iterator[str]: ...

    def close(self) -> None: ...


class HttpBackend:
    """Streams from `url`'s /v1/chat/completions; `model` None: the first of /v1/models. ChatError."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                 transport=transport)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        body = self._check(self._send(lambda: self.http.get("/v1/models"))).json()
        models = body.get("data") or []
        if not models:
            raise ChatError(f"{self.url}/v1/models lists no model; name one with --model")
        return models[0]["id"]

    def stream(self, turn: Turn) -> Iterator[str]:
        body = {"model": self.model, "messages": turn.messages, "stream": True,
                "temperature": turn.temperature, "max_tokens": turn.max_tokens}
        request = self.http.build_request("POST", "/v1/chat/completions", json=body)
        response = self._send(lambda: self.http.send(request, stream=True))
        try:   # closing the response drops the connection: the server aborts
            if response.status_code != 200:
                response.read()
                self._check(response)
            for line in self._lines(response):
                if line == "[DONE]":
                    return
                event = json.loads(line)
                if "error" in event:
                    raise ChatError(f"the server stopped the reply: {_message(event)}")
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text
        finally:
            response.close()

    def _lines(self, response: httpx.Response) -> Iterator[str]:
        try:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    yield line[len("data:"):].strip()
        except httpx.HTTPError as exc:
            raise ChatError(f"the connection to {self.url} broke mid-reply: {_reason(exc)}") from None

    def _send(self, send) -> httpx.Response:
        try:
            return send()
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {_reason(exc)}") from None

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code != 200:
            try:
                detail = _message(response.json())
            except ValueError:
                detail = response.text.strip()[:200]
            raise ChatError(f"{self.url} answered {response.status_code}: {detail}")
        return response

    def close(self) -> None:
        self.http.close()


class LocalBackend:
    """Generates in-process (`LLM.stream_chat`); `model_path` None: the default model. ModelPathError."""

    def __init__(self, model_path: str | None = None):
        from radixserve.llm import LLM

        self.llm = LLM(model_path)

    def stream(self, turn: Turn) -> Iterator[str]:
        from radixserve.errors import RadixServeError
        from radixserve.sampling_params import SamplingParams

        params = SamplingParams(temperature=turn.temperature, max_tokens=turn.max_tokens)
        try:
            yield from self.llm.stream_chat(turn.messages, params)
        except RadixServeError as exc:
            raise ChatError(str(exc)) from None

    def close(self) -> None:
        """Nothing to release."""


def _message(body: object) -> str:
    """The message of an OpenAI error body, or the body itself."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:200]


def _reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host unknown (is `radixserve serve` running there?)"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"
