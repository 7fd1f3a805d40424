"""Output anomalies end to end: `radixserve fleet` with two tiny workers that act on the text
heuristics (--anomaly-guard-action abort), one of them garbling its output (the corrupt fault).
A non-streamed request stopped there comes back clean from the other worker, retried from the
prompt; a stream stopped there after its first content ends with the error event and is not
continued (docs/anomaly_guard.md; the rules against fake workers: test_router_anomaly.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.api.conftest import API_KEY
from tests.api.router_fixtures import ROUTER_FLAGS, Fleet, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUESTS = 20    # non-streamed requests until one has met the garbling worker (round robin: the 1st or 2nd)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    # round robin: cache-aware routing may keep every prompt of this family on the clean worker
    f = Fleet(tiny_model_dir, router_flags=[*ROUTER_FLAGS, "--policy", "round_robin"],
              worker_flags=("--anomaly-guard-action", "abort")).wait_ready()
    yield f
    f.stop()


def router_anomalies(fleet: Fleet) -> dict[tuple[str, str], float]:
    return {(s.labels["kind"], s.labels["action"]): s.value for fam in fleet.metric_samples()
            for s in fam.samples if s.name == "radixserve_router:output_anomalies_total"}


def garble(url: str) -> None:
    r = httpx.post(f"{url}/admin/fault", headers=AUTH, json={"kind": "corrupt", "mode": "garble"},
                   trust_env=False)
    assert r.status_code == 200, r.text


def clear(url: str) -> None:
    httpx.delete(f"{url}/admin/fault", headers=AUTH, trust_env=False)


def test_a_stopped_request_comes_back_clean_from_the_other_worker(fleet):
    a, b = fleet.urls
    garble(a)
    try:
        for n in range(MAX_REQUESTS):
            body = {"prompt": f"Tell me about number {n}", "max_tokens": 48, "ignore_eos": True,
                    "temperature": 0}
            r = fleet.complete(**body)
            assert r.status_code == 200, r.text
            if router_anomalies(fleet).get(("garbled", "retried")):
                break
        else:
            pytest.fail(f"none of {MAX_REQUESTS} requests met the garbling worker")
    finally:
        clear(a)
    direct = fleet.complete(**body, base_url=b)    # greedy: b's own answer, from the prompt
    assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert fleet.workers()[a]["num_failures"] >= 1


def test_a_stream_stopped_after_content_ends_with_the_error_event(fleet):
    a, b = fleet.urls
    wait_for(fleet.all_healthy, "a's breaker to close again after the first test's failures")
    fleet.admin("POST", "/admin/drain", json={"url": b})    # the stream goes to a
    garble(a)
    events = []
    try:
        body = {"model": "tiny", "prompt": "Stream a long one", "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with fleet.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
            fleet.admin("POST", "/admin/undrain", json={"url": b})   # b could take a continuation
            before_b = fleet.counts()[b]
            for line in lines:
                if line.startswith("data: "):
                    payload = line[6:]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    finally:
        fleet.admin("POST", "/admin/undrain", json={"url": b})
        clear(a)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "output_anomaly" and error["anomaly_kind"] == "garbled"
    finishes = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"]
    assert fleet.counts()[b] == before_b    # not continued on b
    assert router_anomalies(fleet)[("garbled", "ended")] == 1
