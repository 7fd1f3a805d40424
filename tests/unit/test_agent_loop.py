"""The agent's loop in-process against a fake router and fake workers (httpx.MockTransport): acts, logs, dry-run, status."""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
import time

import httpx

from radixserve.agent import ladder, rules
from radixserve.agent.actions import Actions
from radixserve.agent.app import status_json
from radixserve.agent.config import LadderConfig
from radixserve.agent.page import status_html
from tests.unit.agent_fakes import URLS, FakeFleet, make_agent, sweeps

def test_a_hung_worker_is_isolated_and_every_step_is_logged(tmp_path):
    fake = FakeFleet(hung={"http://w1"})
    agent = make_agent(tmp_path, fake)
    records = sweeps(agent, 6)
    assert fake.posts == [("/admin/drain", {"url": "http://w1", "by": "agent"})]
    actions = [r["action"] for r in records if r["worker"] == "http://w1"]
    assert actions[:2] == ["suspect", "isolate"] and "none" in actions  # then waits, logged
    iso = next(r for r in records if r["action"] == "isolate")
    assert iso["result"].startswith("ok") and iso["findings"][0]["kind"] == "unresponsive"
    assert iso["observed"]["health_error"] == "timeout"
    logged = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert logged == records
    assert records[0]["action"] == "none" and "no rule fired" in records[0]["reason"]


def test_dry_run_logs_the_decision_and_does_not_act(tmp_path):
    fake = FakeFleet(hung={"http://w1"})
    agent = make_agent(tmp_path, fake, dry_run=True)
    records = sweeps(agent, 6)
    assert fake.posts == []
    iso = [r for r in records if r["action"] == "isolate"]
    assert len(iso) == 1 and iso[0]["result"] == "dry-run" and iso[0]["dry_run"]


def test_status_and_metrics_describe_the_fleet(tmp_path):
    fake = FakeFleet(hung={"http://w2"})
    agent = make_agent(tmp_path, fake)
    sweeps(agent, 5)
    status = status_json(agent)
    rows = {r["url"]: r for r in status["workers"]}
    assert rows["http://w2"]["state"] == "isolated" and rows["http://w0"]["state"] == "observe"
    assert status["recent_decisions"] and "GPU" in status["gpu"]   # read, or why not
    page = status_html(status)
    assert "<table" in page and "http://w2" in page
    text = agent.metrics.render().decode()
    assert 'radixserve_agent:worker_state{state="isolated",worker="http://w2"} 1.0' in text
    assert 'radixserve_agent:decisions_total{action="isolate"} 1.0' in text


def test_every_action_and_finding_kind_is_exported_at_zero_before_it_happens(tmp_path):
    """Prometheus's increase() cannot see a series that first appears at 1, so the dashboard
    relies on these starting at 0; the lists must name every kind the rules and ladder use."""
    text = make_agent(tmp_path, FakeFleet(hung=set())).metrics.render().decode()
    for family, label, values in (("decisions", "action", ladder.ACTIONS),
                                  ("actions_failed", "action", ladder.ACTING),
                                  ("findings", "kind", rules.FINDING_KINDS)):
        for value in values:
            assert f'radixserve_agent:{family}_total{{{label}="{value}"}} 0.0' in text
    kinds = set(re.findall(r'Finding\("(\w+)"', inspect.getsource(rules))) | set(ladder.KIND_CLASS)
    assert kinds <= set(rules.FINDING_KINDS), kinds - set(rules.FINDING_KINDS)
    actions = set(re.findall(r'(?:Decision\(|_move\(t, )"(\w+)"', inspect.getsource(ladder)))
    assert actions and actions <= set(ladder.ACTIONS), actions - set(ladder.ACTIONS)


BAD_URLS = ["http://[::1", "http://127.0.0.1:abc", "http:"]   # InvalidURL x2, UnsupportedProtocol


def test_a_worker_with_a_bad_url_is_unreadable_and_the_rest_of_the_fleet_is_still_read(tmp_path):
    fake = FakeFleet(hung=set(), urls=BAD_URLS + URLS)
    agent = make_agent(tmp_path, fake, dry_run=True)
    records = sweeps(agent, 4)      # raised httpx.InvalidURL out of every sweep before
    snap = agent.last
    assert agent.metrics.sweeps._value.get() == 4
    for url in URLS:
        assert snap.workers[url].health_ok and snap.workers[url].metrics
        assert snap.workers[url].info == {"engine_pid": 1234, "engine": {}}
    errors = {u: snap.workers[u].health_error for u in BAD_URLS}
    assert not any(snap.workers[u].health_ok for u in BAD_URLS), errors
    assert "InvalidURL" in errors["http://[::1"] and "UnsupportedProtocol" in errors["http:"]
    flagged = {f.url for f in agent.findings if f.kind == "unresponsive"}
    assert flagged == set(BAD_URLS)          # each bad URL is its own unresponsive worker
    suspects = {r["worker"] for r in records if r["action"] == "suspect"}
    assert suspects and suspects <= set(BAD_URLS)


def test_a_probe_against_a_bad_peer_url_records_no_peer_latency(tmp_path):
    agent = make_agent(tmp_path, FakeFleet(hung=set()))

    async def go():
        try:
            return await agent.observer.probe("http://w0", "http://[::1", 5.0, 4)
        finally:
            await agent.aclose()
    probe = asyncio.run(go())
    assert probe.latency_s is not None and probe.peer_latency_s is None


def test_bad_worker_answers_are_unreadable_not_fatal(tmp_path):
    class Odd(FakeFleet):
        def __call__(self, request):
            if request.url.host == "w1" and request.url.path == "/get_server_info":
                return httpx.Response(200, json=[1, 2])            # JSON, not an object
            if request.url.host == "w1" and request.url.path == "/metrics":
                return httpx.Response(200, text="not { prometheus")
            if request.url.host == "w2" and request.url.path == "/get_server_info":
                return httpx.Response(200, json={"engine_pid": "abc"})
            return super().__call__(request)
    agent = make_agent(tmp_path, Odd(hung=set()))
    sweeps(agent, 2)
    w1 = agent.last.workers["http://w1"]
    assert w1.health_ok and w1.info is None and w1.metrics == {}
    assert agent._engine_pid("http://w2") is None and agent._engine_pid("http://w0") == 1234


def test_a_router_read_timeout_is_logged_with_its_type(tmp_path, caplog):
    fake = FakeFleet(hung=set())
    fake.router_down = True
    agent = make_agent(tmp_path, fake)
    with caplog.at_level("WARNING", logger="radixserve.agent"):
        records = sweeps(agent, 2)
    lines = [r.getMessage() for r in caplog.records if "router view unavailable" in r.getMessage()]
    assert lines and all("ReadTimeout" in line for line in lines), lines
    assert len(records) == 1 and "ReadTimeout" in records[0]["reason"]


def test_the_agent_app_answers_openai_errors_and_serves_no_docs(tmp_path):
    from fastapi.testclient import TestClient

    from radixserve.agent.app import build_app
    agent = make_agent(tmp_path, FakeFleet(hung=set()))
    with TestClient(build_app(agent, run_loop=False)) as client:
        for method, path, status in (("POST", "/status", 405), ("DELETE", "/health", 405),
                                     ("GET", "/nope", 404), ("GET", "/docs", 404),
                                     ("GET", "/openapi.json", 404), ("GET", "/redoc", 404)):
            r = client.request(method, path)
            assert r.status_code == status, (method, path, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
            assert error["type"] == ("not_found_error" if status == 404
                                     else "invalid_request_error")
        assert "GET" in client.post("/status").headers["allow"]
        for path in ("/status", "/health", "/metrics", "/status.html"):
            assert client.get(path).status_code == 200, path
            head = client.head(path)
            assert head.status_code == 200 and head.content == b"", path


def test_a_malformed_router_listing_is_a_router_error_or_skipped_entries(tmp_path):
    """The shapes a broken router answered in QA; each used to fail the sweep with a TypeError,
    KeyError, AttributeError or ValueError out of the agent's own code."""
    shapes = iter([{"status": "ok"}, [], None, {"workers": None}, {"workers": [1, "x", None]},
                   {"workers": [{"url": 5}]}, {"workers": [{"nourl": 1}]},
                   {"workers": [{"url": "http://w0", "healthy": "yes", "in_flight": "many",
                                 "breaker": 7}, {"url": "http://w1", "in_flight": [1]}]}])

    class Broken(FakeFleet):
        def __call__(self, request):
            if request.url.host == "router" and request.url.path == "/admin/workers":
                return httpx.Response(200, json=next(shapes))
            if request.url.host == "router" and request.url.path == "/admin/policy":
                return httpx.Response(200, json="cache_aware")        # not an object
            return super().__call__(request)
    agent = make_agent(tmp_path, Broken(hung=set()))
    sweeps(agent, 8)           # raised out of the sweep for five of these shapes before
    assert agent.num_sweeps == 8 and agent.metrics.sweeps._value.get() == 4
    assert set(agent.last.workers) == {"http://w0", "http://w1"} and agent.last.policy is None


def test_actions_reap_exited_restarted_workers():
    """A restarted worker that exits (the fleet stopped it) is reaped at the next sweep, not
    left a zombie that a fleet stop would wait on."""
    actions = Actions(admin=None, manifest_path=None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    actions.children[child.pid] = child
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.pid in actions.children:
        actions.reap()
        time.sleep(0.05)
    assert child.pid not in actions.children
    assert child.returncode == 0  # waited for: no zombie left


def test_a_new_agent_adopts_its_predecessors_drain_and_leaves_the_operators_alone(tmp_path):
    """An agent isolates hung w1 (drained "by": "agent") and stops; w0 is drained by the
    operator. A new agent (ejection time 0, so no waiting) adopts w1 as isolated, keeps it
    out while it does not answer, returns it once it does, and never touches w0."""
    fake = FakeFleet(hung={"http://w1"})
    sweeps(make_agent(tmp_path / "a", fake), 6)
    assert fake.entry("http://w1")["drained_by"] == "agent"
    fake.draining.add("http://w0")                 # the operator's POST /admin/drain
    fake.posts.clear()
    agent = make_agent(tmp_path / "b", fake, ladder_cfg=LadderConfig(base_ejection_s=0.0))
    records = sweeps(agent, 3, between=lambda k: fake.hung.clear() if k == 1 else None)
    assert fake.posts == [("/admin/undrain", {"url": "http://w1", "by": "agent"})]
    w1 = [(r["sweep"], r["action"], r["state_to"]) for r in records if r["worker"] == "http://w1"]
    assert w1[0] == (1, "adopt", "isolated") and w1[-1] == (3, "undrain", "reintegrating")
    assert "drained at the router by an earlier agent" in records[0]["reason"]
    assert not any(r["worker"] == "http://w0" for r in records)
    assert fake.entry("http://w0")["drained_by"] == "operator"
    assert agent.ladder.tracks["http://w0"].state == "observe"


def test_only_the_first_sweep_that_reads_the_router_adopts(tmp_path):
    """The router unreachable at start-up: adoption waits for the first listing, and happens
    once (a drain by the agent seen later is this agent's own)."""
    fake = FakeFleet(hung=set())
    fake.draining.add("http://w2")
    fake.by_agent.add("http://w2")
    fake.router_down = True
    agent = make_agent(tmp_path, fake, ladder_cfg=LadderConfig(base_ejection_s=60.0))

    def between(k: int) -> None:
        fake.router_down = False
    records = sweeps(agent, 4, between)
    assert [r["sweep"] for r in records if r["action"] == "adopt"] == [2]
    assert agent.ladder.tracks["http://w2"].state == "isolated" and fake.posts == []
