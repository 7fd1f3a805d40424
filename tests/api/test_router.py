"""Router integration tests: a fleet of two tiny workers on loopback behind `radixserve route` (issue 5)."""
from __future__ import annotations

import json
import random
import socket
import threading

import httpx
import pytest

from radixserve.router.client import RouterAdminClient, RouterAdminError
from tests.api.conftest import API_KEY
from tests.api.router_fixtures import ADMIN_KEY, Fleet, pid_alive, wait_for

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu river stone cloud maple copper silver garden window").split()
METRIC_NAMES = ("requests", "retries", "retries_exhausted", "breaker_state",
                "breaker_transitions", "health_checks", "in_flight", "routing_decisions",
                "added_latency_seconds")


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    f = Fleet(tiny_model_dir).wait_ready()
    yield f
    f.stop()


def usage_rate(responses: list[httpx.Response]) -> float:
    usages = [r.json()["usage"] for r in responses]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return cached / sum(u["prompt_tokens"] for u in usages)


def flush(url: str) -> None:
    r = httpx.post(url + "/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"},
                   trust_env=False)
    assert r.status_code == 200, r.text


def send_groups(fleet: Fleet, prompts: list[tuple[int, str]], base_url: str | None = None,
                placed: dict[int, set[str]] | None = None) -> list[httpx.Response]:
    """The first prompt of every group at once (long outputs, so all are in flight together:
    the router's in-flight counts spread the groups), then the rest one by one; `placed`
    collects the worker of each later request by group."""
    groups = len({g for g, _ in prompts})
    first = fleet.complete_all([p for _, p in prompts[:groups]], max_tokens=32, ignore_eos=True,
                               base_url=base_url)
    rest = []
    for g, prompt in prompts[groups:]:
        if placed is None:
            rest.append(fleet.complete(prompt, base_url=base_url))
            continue
        worker, r = fleet.served_by(lambda: fleet.complete(prompt))
        placed.setdefault(g, set()).add(worker)
        rest.append(r)
    responses = first + rest
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return responses


def test_shared_prefix_groups_stay_on_one_worker_with_single_worker_hit_rate(fleet):
    rng = random.Random(5)
    systems = [f"System prompt of group {g}: " + text(rng, 150) for g in range(4)]
    # Interleaved groups, as concurrent users would send them.
    prompts = [(g, systems[g] + f"\nQuestion {j}: " + text(rng, 8))
               for j in range(6) for g in range(4)]
    for url in fleet.urls:
        flush(url)
    placed: dict[int, set[str]] = {}
    routed = send_groups(fleet, prompts, placed=placed)
    assert all(len(workers) == 1 for workers in placed.values()), placed
    assert set().union(*placed.values()) == set(fleet.urls), placed  # both workers serve groups
    flush(fleet.urls[0])
    direct = send_groups(fleet, prompts, base_url=fleet.urls[0])
    single, through_router = usage_rate(direct), usage_rate(routed)
    assert single > 0.5, single  # the workload does share prefixes
    assert abs(through_router - single) <= 0.1 * single, (through_router, single)


def test_hot_prefix_at_high_concurrency_spreads(fleet):
    admin = RouterAdminClient(fleet.router_url, ADMIN_KEY)
    before_params = admin.get_policy()
    admin.set_policy_params(balance_abs_threshold=2)
    try:
        rng = random.Random(7)
        hot = "Hot shared prefix: " + text(rng, 120)
        before = fleet.counts()
        responses = fleet.complete_all([hot + f" #{i}" for i in range(24)], max_tokens=32,
                                       ignore_eos=True)
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        after = fleet.counts()
        share = {url: after[url] - before[url] for url in after}
        assert min(share.values()) > 0, share  # the dead-band spilled the hot prefix
    finally:
        admin.set_policy_params(**{k: v for k, v in before_params.items() if k != "policy"})
        admin.close()
    decisions = {s.labels["reason"]: s.value for fam in fleet.metric_samples()
                 if fam.name == "radixserve_router:routing_decisions" for s in fam.samples
                 if s.name.endswith("_total")}
    assert decisions.get("imbalance", 0) > 0, decisions


def test_context_length_errors_same_through_router_as_direct(fleet):
    """Field case C09 (the brief's C05): L-1 fits, L and L+500 get the worker's 400."""
    limit = fleet.http.get("/v1/models").json()["data"][0]["max_model_len"]
    for n, ok in ((limit - 1, True), (limit, False), (limit + 500, False)):
        routed = fleet.complete([1000] * n, max_tokens=1)
        direct = fleet.complete([1000] * n, max_tokens=1, base_url=fleet.urls[0])
        assert routed.status_code == direct.status_code == (200 if ok else 400), routed.text
        if not ok:
            assert routed.json() == direct.json()
            assert routed.json()["error"]["code"] == "context_length_exceeded"
    assert fleet.complete("Hello").status_code == 200


def test_client_errors_pass_through_and_never_open_breakers(fleet):
    before = fleet.workers()
    for _ in range(12):  # more than --cb-failure-threshold (5)
        r = fleet.complete("Hi", max_tokens=-1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    no_key = httpx.post(fleet.router_url + "/v1/completions", trust_env=False,
                        json={"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    for body in (b"{not json", b"", b"[1, 2]"):
        r = fleet.http.post("/v1/chat/completions", content=body,
                            headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    after = fleet.workers()
    for url, w in after.items():
        assert w["breaker"] == "closed" and w["healthy"], w
        assert w["num_failures"] == before[url]["num_failures"], w
    outcomes = {(s.labels["outcome"]): s.value for fam in fleet.metric_samples()
                if fam.name == "radixserve_router:requests" for s in fam.samples
                if s.name.endswith("_total")}
    assert outcomes.get("client_error", 0) >= 13, outcomes


def read_events(response: httpx.Response) -> list:
    """Parsed `data:` payloads of an SSE response ([DONE] kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_stream_relayed_equals_direct_text(fleet):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 12, "temperature": 0}
    direct = fleet.http.post(fleet.urls[1] + "/v1/chat/completions", json=body).json()
    with fleet.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r)
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == direct["choices"][0]["message"]["content"]


def worker_metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(url + "/metrics", trust_env=False)
    return sum(s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
               if s.name == name)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_upstream_and_releases_load(fleet, stream):
    """A client that leaves mid-request: the router cancels the upstream request (the worker
    aborts it, field case C06 through the router) and releases its in-flight count."""
    aborted = "radixserve:num_aborted_requests_total"
    before = sum(worker_metric(u, aborted) for u in fleet.urls)
    body = json.dumps({"model": "tiny", "prompt": "Leave early", "max_tokens": 480,
                       "ignore_eos": True, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", fleet.port)) as sock:
        sock.sendall(head + body)
        wait_for(lambda: sum(w["in_flight"] for w in fleet.workers().values()) == 1,
                 "the request in flight")
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    wait_for(lambda: sum(w["in_flight"] for w in fleet.workers().values()) == 0,
             "the in-flight count released")
    wait_for(lambda: sum(worker_metric(u, aborted) for u in fleet.urls) == before + 1,
             "the worker to abort the request")


def test_admin_drain_weight_and_membership(fleet):
    a, b = fleet.urls
    admin = RouterAdminClient(fleet.router_url, ADMIN_KEY)
    try:
        listing = {w["url"]: w for w in admin.list_workers()}
        assert set(listing) == {a, b}
        for key in ("healthy", "draining", "weight", "in_flight", "load", "breaker", "reported",
                    "hit_estimate", "num_requests", "num_failures"):
            assert key in listing[a], key
        # A long request pinned to a (b drained), then a drained while it runs.
        admin.drain(b)
        # Slow a's steps so the long request is surely still running while we look at it.
        slow = httpx.post(f"{a}/admin/fault", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"kind": "step_latency", "latency_ms": 100, "duration_s": 60})
        assert slow.status_code == 200, slow.text
        result: list[httpx.Response] = []
        long = threading.Thread(target=lambda: result.append(
            fleet.complete("Long one", max_tokens=48, ignore_eos=True)))
        long.start()
        wait_for(lambda: fleet.workers()[a]["in_flight"] == 1, "the long request on a")
        admin.undrain(b)
        drained = admin.drain(a)
        assert drained["draining"] and drained["in_flight"] == 1
        before = fleet.counts()
        assert all(r.status_code == 200 for r in fleet.complete_all(["x", "y", "z", "w"]))
        assert fleet.counts()[a] == before[a]  # a took nothing new
        httpx.delete(f"{a}/admin/fault", headers={"Authorization": f"Bearer {API_KEY}"})
        long.join(120)
        assert result and result[0].status_code == 200, result  # in-flight finished
        assert fleet.workers()[a]["in_flight"] == 0
        admin.undrain(a)
        # Weight 0 takes a out of routing; weight 1 brings it back.
        assert admin.set_weight(a, 0)["weight"] == 0
        before = fleet.counts()
        fleet.complete_all(["p", "q", "r"])
        assert fleet.counts()[a] == before[a]
        admin.set_weight(a, 1)
        # Remove and add back: a is health-checked, then routable.
        assert admin.remove_worker(a)["removed"] == a
        assert [w["url"] for w in admin.list_workers()] == [b]
        assert fleet.complete("after removal").status_code == 200
        added = admin.add_worker(a, weight=1.0)
        assert added["url"] == a and added["weight"] == 1.0
        wait_for(lambda: fleet.all_healthy(), "the re-added worker to be healthy")
        assert admin.get_policy()["policy"] == "cache_aware"
    finally:
        httpx.delete(f"{a}/admin/fault", headers={"Authorization": f"Bearer {API_KEY}"})
        for url in (a, b):
            if url in fleet.workers():
                admin.undrain(url)
        admin.close()


def test_admin_errors(fleet):
    a = fleet.urls[0]
    assert fleet.admin("GET", "/admin/workers", key="wrong").status_code == 401
    r = fleet.admin("POST", "/admin/drain", key=None, json={"url": a})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    cases = [("/admin/drain", {"url": "http://127.0.0.1:1"}, 404, "not_found_error"),
             ("/admin/remove_worker", {"url": "http://127.0.0.1:1"}, 404, "not_found_error"),
             ("/admin/drain", {"nourl": 1}, 400, "invalid_request_error"),
             ("/admin/set_weight", {"url": a, "weight": -1}, 400, "invalid_request_error"),
             ("/admin/set_weight", {"url": a, "weight": "x"}, 400, "invalid_request_error"),
             ("/admin/add_worker", {"url": a}, 400, "invalid_request_error"),
             ("/admin/set_policy_params", {"cache_threshold": 2}, 400, "invalid_request_error"),
             ("/admin/set_policy_params", {"bogus": 1}, 400, "invalid_request_error")]
    for path, body, status, kind in cases:
        r = fleet.admin("POST", path, json=body)
        assert r.status_code == status and r.json()["error"]["type"] == kind, (path, r.text)
    r = fleet.admin("POST", "/admin/drain", content=b"{oops",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    with pytest.raises(RouterAdminError) as err:
        RouterAdminClient(fleet.router_url, "wrong").list_workers()
    assert err.value.status == 401


def test_metrics_have_contract_names(fleet):
    assert fleet.complete("metrics please").status_code == 200
    families = {fam.name: fam for fam in fleet.metric_samples()}
    for name in METRIC_NAMES:
        assert f"radixserve_router:{name}" in families, sorted(families)
    in_flight = {s.labels["worker"] for s in families["radixserve_router:in_flight"].samples}
    assert in_flight == set(fleet.urls)
    checks = families["radixserve_router:health_checks"].samples
    assert any(s.labels["result"] == "pass" and s.value > 0 for s in checks)
    assert families["radixserve_router:added_latency_seconds"].samples


def test_killed_worker_loses_no_request_and_rejoins_after_health_checks(fleet):
    """Issue 5 and field case C20: SIGKILL a worker mid-run, GETs through the router, restart."""
    a, b = fleet.urls
    rng = random.Random(11)

    s_prompt = "Affinity " + text(rng, 60)
    fleet.admin("POST", "/admin/drain", json={"url": a})  # S is placed on b
    try:
        assert fleet.served_by(lambda: fleet.complete(s_prompt))[0] == b
    finally:
        fleet.admin("POST", "/admin/undrain", json={"url": a})
    prompts = [text(rng, 20) for _ in range(16)]
    results: list[httpx.Response] = []
    run = threading.Thread(target=lambda: results.extend(
        fleet.complete_all(prompts, max_tokens=24, ignore_eos=True)))
    run.start()
    wait_for(lambda: fleet.workers()[a]["in_flight"] > 0, "requests in flight on a")
    fleet.kill(a)
    run.join(300)
    assert len(results) == 16 and all(r.status_code == 200 for r in results), \
        [r.text for r in results if r.status_code != 200]
    # GET routes and /health are answered by the survivor (C20).
    assert fleet.http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert fleet.http.get("/health").status_code == 200
    wait_for(lambda: not fleet.workers()[a]["healthy"], "a marked unhealthy")
    worker, r = fleet.served_by(lambda: fleet.complete(s_prompt))  # affinity kept (C20)
    assert worker == b and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with fleet.http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": s_prompt, "max_tokens": 4, "stream": True}) as stream:
        assert stream.status_code == 200 and read_events(stream)[-1] == "[DONE]"
    before = fleet.counts()
    assert all(fleet.complete(text(rng, 10)).status_code == 200 for _ in range(6))
    assert fleet.counts()[a] == before[a]  # nothing more sent to the dead worker
    fleet.restart(a)
    wait_for(lambda: fleet.workers()[a]["healthy"], "a healthy again")
    # its new instance id: healthy, breaker closed and old load reading dropped at one check
    assert fleet.workers()[a]["breaker"] == "closed"

    def a_takes_some() -> bool:  # at once, so in-flight counts (not idle load ties) decide
        before = fleet.counts()[a]
        batch = fleet.complete_all([text(rng, 10) for _ in range(6)], max_tokens=16,
                                   ignore_eos=True)
        assert all(r.status_code == 200 for r in batch)
        return fleet.counts()[a] > before
    wait_for(a_takes_some, "requests routed to the restarted worker")


def test_worker_death_mid_stream_continues_on_the_survivor_without_replay(fleet):
    """Field case C20: the stream's worker dies after the first byte reached the client; the
    stream continues on the other worker (stream migration) under the same response id, with
    nothing sent twice (docs/stream_migration.md; without migration: an error event, see
    test_router_migration.py)."""
    a, b = fleet.urls
    body = {"model": "tiny", "prompt": "Stream a long one", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    events = []
    fleet.admin("POST", "/admin/drain", json={"url": b})  # the stream goes to a
    try:
        with fleet.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
            assert fleet.workers()[a]["in_flight"] == 1
            fleet.admin("POST", "/admin/undrain", json={"url": b})
            fleet.kill(a)
            for line in lines:
                if line.startswith("data: "):
                    payload = line[6:]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    finally:
        fleet.admin("POST", "/admin/undrain", json={"url": b})
    assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e], events[-3:]
    ids = {e["id"] for e in events[:-1]}
    assert len(ids) == 1, ids  # one response id, continued
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert fleet.complete("after the stream died").status_code == 200  # the survivor serves


def test_fleet_sigterm_stops_every_process(fleet):
    engines = [httpx.get(u + "/get_server_info", trust_env=False,
                         headers={"Authorization": f"Bearer {API_KEY}"}).json()["engine_pid"]
               for u in fleet.urls if u not in fleet.restarted]
    pids = [w["pid"] for w in fleet.manifest["workers"] if w["url"] not in fleet.restarted]
    assert fleet.stop() == 0, fleet.output()
    wait_for(lambda: not any(pid_alive(p) for p in pids + engines), "no fleet process left", 30)


def test_route_cli_rejects_bad_flags():
    from radixserve.router.cli import main
    assert main(["--cache-threshold", "2"]) == 2
    with pytest.raises(SystemExit):
        main(["--policy", "nonsense"])
