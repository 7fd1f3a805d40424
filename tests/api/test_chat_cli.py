"""`radixserve chat` with piped stdin on the tiny random-weight model: against a real server
(subprocess) and in-process; every streamed reply equals the same conversation sent whole."""
from __future__ import annotations

import io
import os
import subprocess
import sys

from radixserve import LLM, SamplingParams, cli
from tests.api.conftest import API_KEY, REPO

LINES = "hello\nmore please\n/reset\nhi again\n/exit\nnever sent\n"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def reference_conversation(reply) -> list[str]:
    """The replies LINES should get, from `reply(messages)` that answers a whole conversation."""
    first = reply([user("hello")])
    second = reply([user("hello"), {"role": "assistant", "content": first}, user("more please")])
    third = reply([user("hi again")])   # after /reset: the history is gone
    return [first, second, third]


def test_piped_chat_against_a_server_streams_each_turn_with_its_history(tiny_server):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "radixserve", "chat", "--url", tiny_server.base_url,
                           "--api-key", API_KEY, "--temperature", "0", "--max-tokens", "8"],
                          input=LINES, capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "(conversation cleared)\n"

    def reply(messages: list[dict]) -> str:
        r = tiny_server.post("/v1/chat/completions", json={
            "model": tiny_server.model, "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    expected = reference_conversation(reply)
    assert any(expected)
    assert done.stdout == "".join(text + "\n" for text in expected)


def test_piped_chat_in_process_on_a_model_path(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(LINES))
    code = cli.main(["chat", "--model-path", str(tiny_model_dir), "--temperature", "0",
                     "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    llm = LLM(str(tiny_model_dir))
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = reference_conversation(
        lambda messages: llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
    assert any(expected)
    assert captured.out == "".join(text + "\n" for text in expected)
