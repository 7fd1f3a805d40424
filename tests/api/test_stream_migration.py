"""Stream migration through a real router over two tiny workers: a worker SIGKILLed or ejected (hung by SIGSTOP) mid-stream, the stream finished by the other, its text equal to an uncut greedy run. Streams are held by the step_latency fault, never by timing."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.api.conftest import API_KEY
from tests.api.router_fixtures import ROUTER_FLAGS, WAIT_S, Fleet, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELD_STEP_MS = 500   # each engine step of a held worker sleeps this long
GREEDY = {"model": "tiny", "max_tokens": 20, "temperature": 0, "ignore_eos": True,
          "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    """Health checks time out after 2 s (5 s by default): a stopped worker is ejected after two of them."""
    f = Fleet(tiny_model_dir, router_flags=[*ROUTER_FLAGS, "--health-check-timeout-s", "2"]).wait_ready()
    yield f
    f.stop()


def hold(url: str) -> None:
    r = httpx.post(url + "/admin/fault", headers=AUTH, timeout=30,
                   json={"kind": "step_latency", "latency_ms": HELD_STEP_MS})
    assert r.status_code == 200, r.text


def release(url: str) -> None:
    assert httpx.delete(url + "/admin/fault", headers=AUTH, timeout=30).status_code == 200


class Reader(threading.Thread):
    """Reads one stream from the router; `got_content` is set once `after` chunks with text
    (or content) have arrived. `events`: parsed JSON events and "[DONE]"."""

    def __init__(self, fleet: Fleet, path: str, body: dict, after: int):
        super().__init__(daemon=True)
        self.fleet, self.path, self.body, self.after = fleet, path, body, after
        self.events: list = []
        self.got_content = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        try:
            with self.fleet.http.stream("POST", self.path, json={**self.body, "stream": True}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if len(self.texts()) >= self.after:
                            self.got_content.set()
        finally:
            self.got_content.set()

    def texts(self) -> list[str]:
        out = []
        for e in self.events:
            for c in e.get("choices", []) if isinstance(e, dict) else []:
                text = c.get("text") or c.get("delta", {}).get("content")
                if text:
                    out.append(text)
        return out


def holding_worker(fleet: Fleet) -> str:
    """The one worker with a request in flight."""
    def busy():
        urls = [url for url, w in fleet.workers().items() if w["in_flight"]]
        return urls[0] if len(urls) == 1 else None
    return wait_for(busy, "a worker holding the stream")


def migrations(fleet: Fleet) -> float:
    return sum(s.value for fam in fleet.metric_samples() for s in fam.samples
               if s.name == "radixserve_router:stream_migrations_total"
               and s.labels["outcome"] == "success")


def cut_stream(fleet: Fleet, path: str, body: dict, after: int) -> tuple[Reader, str]:
    """Start `body` streaming through the router with both workers held, SIGKILL the worker
    serving it once `after` content chunks arrived, release the other, read to the end.
    Returns the reader and the surviving worker's URL (the killed one is restarted)."""
    for url in fleet.urls:
        hold(url)
    reader = Reader(fleet, path, body, after)
    reader.start()
    victim = holding_worker(fleet)
    survivor = next(url for url in fleet.urls if url != victim)
    if after:
        assert reader.got_content.wait(WAIT_S)
    release(survivor)
    fleet.kill(victim)
    reader.join(WAIT_S)
    assert not reader.is_alive() and reader.status == 200
    fleet.restart(victim)
    wait_for(fleet.all_healthy, "both workers back in rotation")
    return reader, survivor


def uncut(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_one_clean_stream(reader: Reader, chat: bool) -> None:
    done = [e for e in reader.events if e == "[DONE]"]
    chunks = [e for e in reader.events if e != "[DONE]"]
    assert reader.events[-1] == "[DONE]" and len(done) == 1
    assert not [e for e in chunks if "error" in e], chunks
    assert len({(e["id"], e["created"]) for e in chunks}) == 1
    assert all("token_ids" not in c for e in chunks for c in e["choices"])
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    if chat:
        assert sum("role" in c["delta"] for e in chunks for c in e["choices"]) == 1


def usage_counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_completion_stream_survives_its_worker_killed_mid_stream(fleet):
    body = {**GREEDY, "prompt": "The migration of a stream keeps every token in its place"}
    before = migrations(fleet)
    reader, survivor = cut_stream(fleet, "/v1/completions", body, after=3)
    assert_one_clean_stream(reader, chat=False)
    assert migrations(fleet) == before + 1
    ref = uncut(survivor, "/v1/completions", {**body, "stream_options": None})
    assert "".join(reader.texts()) == ref["choices"][0]["text"]
    assert usage_counts(reader.events[-2]["usage"]) == usage_counts(ref["usage"])
    assert ref["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_chat_stream_survives_its_worker_killed_mid_content(fleet):
    body = {**GREEDY, "messages": [{"role": "user", "content": "Tell me about rivers."}]}
    before = migrations(fleet)
    reader, survivor = cut_stream(fleet, "/v1/chat/completions", body, after=3)
    assert_one_clean_stream(reader, chat=True)
    assert migrations(fleet) == before + 1
    ref = uncut(survivor, "/v1/chat/completions", {**body, "stream_options": None})
    assert "".join(reader.texts()) == ref["choices"][0]["message"]["content"]
    assert usage_counts(reader.events[-2]["usage"]) == usage_counts(ref["usage"])


def test_chat_stream_whose_worker_dies_before_content_is_retried(fleet):
    body = {**GREEDY, "messages": [{"role": "user", "content": "Name a colour."}]}
    before = migrations(fleet)
    reader, survivor = cut_stream(fleet, "/v1/chat/completions", body, after=0)
    assert_one_clean_stream(reader, chat=True)
    assert migrations(fleet) == before  # nothing had reached the client: a plain retry
    ref = uncut(survivor, "/v1/chat/completions", {**body, "stream_options": None})
    assert "".join(reader.texts()) == ref["choices"][0]["message"]["content"]


def test_stream_of_a_worker_ejected_mid_stream_finishes_on_the_survivor(fleet):
    """The serving worker hangs after content (SIGSTOP: its connections stay open, it sends
    nothing and its /health answers nothing). The router ejects it after
    --health-failure-threshold failed checks and continues the stream on the survivor, long
    before --silence-timeout-s (300 s) would have cut it. SIGCONT brings the worker back."""
    body = {**GREEDY, "prompt": "An ejected worker hands its stream over to the survivor"}
    before = migrations(fleet)
    for url in fleet.urls:
        hold(url)
    reader = Reader(fleet, "/v1/completions", body, after=3)
    reader.start()
    victim = holding_worker(fleet)
    survivor = next(url for url in fleet.urls if url != victim)
    assert reader.got_content.wait(WAIT_S)
    release(survivor)
    os.killpg(fleet.pid_of(victim), signal.SIGSTOP)
    try:
        wait_for(lambda: not fleet.workers()[victim]["healthy"], "the router to eject the victim")
        reader.join(WAIT_S)
        assert not reader.is_alive() and reader.status == 200
        assert fleet.workers()[victim]["in_flight"] == 0
    finally:
        os.killpg(fleet.pid_of(victim), signal.SIGCONT)
    assert_one_clean_stream(reader, chat=False)
    assert migrations(fleet) == before + 1
    ref = uncut(survivor, "/v1/completions", {**body, "stream_options": None})
    assert "".join(reader.texts()) == ref["choices"][0]["text"]
    assert usage_counts(reader.events[-2]["usage"]) == usage_counts(ref["usage"])
    release(victim)
    wait_for(fleet.all_healthy, "both workers back in rotation")
