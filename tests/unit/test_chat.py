"""`radixserve chat` without a model: the turn loop (history, /reset, /exit, Ctrl-C, errors) over a
fake backend, the HTTP backend over httpx.MockTransport, and an unreachable URL."""
from __future__ import annotations

import io
import json
import socket

import httpx
import pytest

from radixserve import cli
from radixserve.chat.backends import ChatError, HttpBackend, Turn
from radixserve.chat.cli import ChatSession, piped_reader


class FakeBackend:
    """Records every turn; replies "reply N" in two deltas, or runs `script` for a turn."""

    def __init__(self, script: dict | None = None):
        self.turns: list[Turn] = []
        self.script = script or {}

    def stream(self, turn: Turn):
        self.turns.append(turn)
        n = len(self.turns)
        return self.script.get(n, lambda: iter(["reply ", str(n)]))()

    def close(self) -> None:
        pass


def run_session(lines: str, backend, system: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(backend, system, 0.5, 32, out, err)
    code = session.run(piped_reader(io.StringIO(lines)))
    return code, out.getvalue(), err.getvalue()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_turns_carry_the_history_and_reset_clears_it_but_keeps_the_system_prompt():
    backend = FakeBackend()
    code, out, err = run_session("hello\n\nand then?\n/reset\nagain\n", backend, system="be brief")
    system = {"role": "system", "content": "be brief"}
    assert [t.messages for t in backend.turns] == [
        [system, user("hello")],
        [system, user("hello"), assistant("reply 1"), user("and then?")],
        [system, user("again")]]
    assert all(t.temperature == 0.5 and t.max_tokens == 32 for t in backend.turns)
    assert (code, out) == (0, "reply 1\nreply 2\nreply 3\n")
    assert err == "(conversation cleared)\n"


def test_exit_stops_reading_and_unknown_commands_are_named():
    backend = FakeBackend()
    code, out, err = run_session("/help\none\n/exit\nnever sent\n", backend)
    assert [t.messages for t in backend.turns] == [[user("one")]]
    assert (code, out) == (0, "reply 1\n")
    assert err.startswith("unknown command /help; commands: /reset")


class Interrupted:
    """A reply that shows one delta, then the user presses Ctrl-C."""

    def __init__(self):
        self.closed = False
        self.sent = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        self.sent += 1
        if self.sent == 1:
            return "half a rep"
        raise KeyboardInterrupt

    def close(self) -> None:
        self.closed = True


def test_ctrl_c_during_a_reply_stops_it_and_the_turn_is_not_kept():
    stopped = Interrupted()
    backend = FakeBackend({1: lambda: stopped})
    code, out, err = run_session("tell me\nshort one\n", backend)
    assert stopped.closed
    assert [t.messages for t in backend.turns] == [[user("tell me")], [user("short one")]]
    assert (code, out) == (0, "half a rep\nreply 2\n")
    assert "reply stopped" in err


def test_ctrl_c_or_ctrl_d_at_the_prompt_leaves_cleanly():
    def ctrl_c() -> str:
        raise KeyboardInterrupt
    session = ChatSession(FakeBackend(), None, 0.7, 8, io.StringIO(), io.StringIO())
    assert session.run(ctrl_c) == 0
    assert run_session("", FakeBackend()) == (0, "", "")


def test_a_failed_turn_is_one_line_leaves_the_history_and_sets_the_exit_code():
    def broken():
        yield "par"
        raise ChatError("the server stopped the reply: output_anomaly")
    backend = FakeBackend({2: broken})
    code, out, err = run_session("one\ntwo\nthree\n", backend)
    assert [t.messages for t in backend.turns][2] == [user("one"), assistant("reply 1"),
                                                      user("three")]
    assert (code, out) == (1, "reply 1\npar\nreply 3\n")
    assert err == "radixserve chat: error: the server stopped the reply: output_anomaly\n"


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_http_backend_sends_the_conversation_and_streams_the_deltas():
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}, {"id": "other"}]})
        return httpx.Response(200, content=sse({"choices": [{"delta": {"role": "assistant"}}]},
                                               delta("Par"), delta("is"), {"choices": []}))

    backend = HttpBackend("http://w:1/", "K", transport=httpx.MockTransport(handle))
    messages = [user("capital of France?")]
    assert list(backend.stream(Turn(messages, 0.0, 9))) == ["Par", "is"]
    models, chat = seen
    assert models.url == "http://w:1/v1/models"
    assert chat.url == "http://w:1/v1/chat/completions"
    assert chat.headers["authorization"] == "Bearer K"
    assert json.loads(chat.content) == {"model": "tiny", "messages": messages, "stream": True,
                                        "temperature": 0.0, "max_tokens": 9}


@pytest.mark.parametrize("status, body, says", [
    (200, sse(delta("a"), {"error": {"message": "output anomaly: repetition", "code": 500}}),
     "the server stopped the reply: output anomaly: repetition"),
    (401, json.dumps({"error": {"message": "invalid API key"}}).encode(),
     "http://w:1 answered 401: invalid API key"),
    (503, b"upstream gone", "http://w:1 answered 503: upstream gone"),
])
def test_http_backend_errors_are_one_line(status, body, says):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    backend = HttpBackend("http://w:1", model="m", transport=transport)
    with pytest.raises(ChatError) as caught:
        list(backend.stream(Turn([user("x")], 1.0, 4)))
    assert str(caught.value) == says


def test_an_unreachable_url_is_one_line_and_exit_1(capsys):
    with socket.socket() as sock:   # a loopback port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert cli.main(["chat", "--url", f"http://127.0.0.1:{port}"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"radixserve chat: error: cannot reach http://127.0.0.1:{port}: "
                            f"connection refused or host unknown (is `radixserve serve` running "
                            f"there?)\n")


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["chat", "--model", "m"])
    assert caught.value.code == 2
    assert "--api-key and --model go with --url" in capsys.readouterr().err
