"""The ops page and the hour it charts: TTFT buckets kept, Prometheus quantiles, a bounded timeline, and what the rendered page says for an empty agent and for a fleet with an isolated worker."""
from __future__ import annotations

import math

from radixserve.agent.app import status_json
from radixserve.agent.charts import Series, nice_ceiling, render
from radixserve.agent.observe import TTFT_BUCKET, WorkerSnapshot, bucket_key, parse_metrics
from radixserve.agent.page import status_html
from radixserve.agent.timeline import Timeline, quantile
from tests.unit.agent_fakes import HUNG, URLS, FakeFleet, assert_shows_the_isolation, Traffic, drained_fleet, make_agent, sweeps
from tests.unit.page_view import read_page

P = "radixserve:"
INF = math.inf


def test_parse_metrics_keeps_the_ttft_buckets_from_a_workers_own_text():
    traffic = Traffic(ttft_s=0.08, requests=20)
    parsed = parse_metrics(traffic.read())
    # 18 at 80 ms, 2 at 320 ms (one in ten is four times slower)
    assert parsed[bucket_key(TTFT_BUCKET, "0.05")] == 0
    assert parsed[bucket_key(TTFT_BUCKET, "0.1")] == 18
    assert parsed[bucket_key(TTFT_BUCKET, "0.25")] == 18
    assert parsed[bucket_key(TTFT_BUCKET, "0.5")] == 20
    assert parsed[bucket_key(TTFT_BUCKET, "+Inf")] == 20
    assert not any("inter_token_latency_seconds_bucket" in k for k in parsed)   # others dropped
    assert parsed[P + "time_to_first_token_seconds_count"] == 20


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    hist = {0.1: 50.0, 0.5: 90.0, INF: 100.0}
    assert quantile(0.5, hist) == 0.1                      # rank 50 ends the first bucket
    assert math.isclose(quantile(0.7, hist), 0.3)          # halfway through (0.1, 0.5]
    assert math.isclose(quantile(0.25, hist), 0.05)        # the first bucket starts at 0
    assert quantile(0.99, hist) == 0.5                     # in +Inf: the highest finite bound
    assert quantile(0.99, {0.1: 0.0, INF: 0.0}) is None    # nothing observed
    assert quantile(0.99, {0.1: 3.0, 0.5: 4.0}) is None    # no +Inf bucket: not a histogram


def snap(t: float, n: float, url: str = "http://w0") -> WorkerSnapshot:
    """A worker after `n` sweeps of 1000 prompt tokens (600 cached), one anomaly and 10 first
    tokens (9 within 0.1 s, 1 within 0.5 s) each."""
    metrics = {P + "prompt_tokens_total": 1000.0 * n, P + "cached_tokens_total": 600.0 * n,
               P + "num_anomalies_total": float(n), bucket_key(TTFT_BUCKET, "0.1"): 9.0 * n,
               bucket_key(TTFT_BUCKET, "0.5"): 10.0 * n, bucket_key(TTFT_BUCKET, "+Inf"): 10.0 * n}
    return WorkerSnapshot(url, t, True, metrics=metrics)


def test_the_timeline_merges_a_step_of_sweeps_and_keeps_one_hour_only():
    timeline, start = Timeline(span_s=3600.0, step_s=10.0), 1_000_000.0
    for k in range(1, 1441):            # two hours of 5 s sweeps, two workers
        hists = {u: [snap(0, k - 1, u), snap(0, k, u)] for u in ("http://w0", "http://w1")}
        timeline.record(start + 5.0 * k, hists, num_actions=1 if k % 100 == 0 else 0)
    now = start + 5.0 * 1440
    points = timeline.points(now)
    assert len(points) <= 361 and points[0].t > now - 3600.0 - 10.0 and points[-1].t <= now
    assert all(b.t - a.t == 10.0 for a, b in zip(points, points[1:]))
    full = points[1]                     # two sweeps x two workers
    assert full.prompt == 4000.0 and full.hit_rate == 0.6 and full.anomalies == 4.0
    assert full.ttft == {0.1: 36.0, 0.5: 40.0, INF: 40.0}
    assert math.isclose(full.ttft_p99_s, 0.1 + 0.4 * (39.6 - 36.0) / 4.0)
    assert sum(p.actions for p in points) == 7          # k = 800, 900, ..., 1400
    assert timeline.points(now + 7200.0) == []          # an hour later nothing is left


def test_the_timeline_skips_a_restart_and_adds_a_clock_step_back_to_the_last_point():
    timeline = Timeline(span_s=3600.0, step_s=10.0)
    timeline.record(100.0, {"http://w0": [snap(0, 5), snap(0, 1)]}, 0)   # counters went down
    assert timeline.points(100.0)[0].prompt == 0 and not timeline.points(100.0)[0].ttft
    timeline.record(95.0, {"http://w0": [snap(0, 1), snap(0, 2)]}, 1)    # clock stepped back
    (only,) = timeline.points(100.0)
    assert only.t == 100.0 and only.prompt == 1000.0 and only.actions == 1


def test_a_line_breaks_where_sweeps_are_missing():
    values = [(0.0, 1.0), (10.0, 2.0), (20.0, 3.0), (100.0, 2.0)]    # a gap, then one point
    svg = render(Series("x", "X", values, "line", str), now=110.0, span_s=120.0, step_s=10.0,
                 gap_s=25.0)
    chart = read_page(svg).charts["x"]
    assert chart.points == 4 and chart.coords == 3 and chart.dots == 1
    assert [nice_ceiling(x) for x in (0.7, 1.0, 3.2, 420.0)] == [1.0, 1.0, 5.0, 500.0]


def test_an_agent_before_its_first_sweep_shows_an_empty_page_without_python_reprs(tmp_path):
    agent = make_agent(tmp_path, FakeFleet(hung=set()))
    page = status_html(status_json(agent))
    view = read_page(page)
    assert "Waiting for the first sweep" in view.text and "no sweep yet" in view.text
    assert '<meta http-equiv="refresh" content="5">' in page     # refreshes itself
    assert view.rows_with("No workers seen yet") and view.rows_with("No decisions yet")
    assert view.tiles == {"Workers": "0", "Healthy": "0/0", "In rotation": "0/0",
                          "Draining": "0", "Out of rotation": "0", "Panic": "no"}
    assert set(view.charts) == {"hit_rate", "ttft_p99", "anomalies", "actions"}
    assert all(c.points == 0 for c in view.charts.values())
    assert view.text.count("no data in the last hour") == 4
    for repr_ in ("None", "[]", "{}", "nan", "True", "False"):
        assert repr_ not in view.text, repr_


def test_a_fleet_with_an_isolated_worker_shows_it_the_decision_and_an_hour_of_charts(tmp_path):
    agent, fake = drained_fleet(tmp_path)
    status = status_json(agent)
    view = read_page(status_html(status))
    assert fake.draining == {HUNG} and status["workers"][1]["state"] == "isolated"
    rows = assert_shows_the_isolation(view)
    w0 = next(r for r in status["workers"] if r["url"] == "http://w0")
    assert rows["http://w0"][2:4] == ["ok", "in"]
    assert rows["http://w0"][8] == f"{w0['hit_rate']:.0%}" and rows["http://w0"][9].endswith("ms")
    (isolate,) = [r for r in view.rows if r[1].startswith("isolate ")]
    assert isolate[2] == HUNG and isolate[5] == "ok" and "suspect → isolated" in isolate[1]
    assert "unresponsive" in isolate[4] and "errors timeout, timeout, timeout" in isolate[4]
    (quiet,) = view.rows_with("no rule fired")        # 4 heartbeats before the hang: one row
    assert quiet[0].count(":") == 4 and quiet[3].endswith("(4 times)")
    charts = view.charts
    assert charts["hit_rate"].points == charts["hit_rate"].coords >= 60   # ~70 sweeps, 20 s apart
    assert charts["ttft_p99"].points == charts["ttft_p99"].coords >= 60
    assert charts["anomalies"].bars == 10 and charts["actions"].bars == 1
    assert "10 in the last hour" in view.text and "1 in the last hour" in view.text
    for repr_ in ("None", "[]", "{}", "nan", "True", "False"):
        assert repr_ not in view.text, repr_


def test_a_busy_worker_still_generating_is_healthy_on_the_page_not_failing(tmp_path):
    """/health timing out while /metrics shows tokens generated is the agent's "busy, not
    hung" (rules.answering); the page says so instead of raising an alarm."""
    busy = "http://w2"
    fake = FakeFleet(hung=set(), busy={busy}, traffic={u: Traffic() for u in URLS})
    agent = make_agent(tmp_path, fake)
    sweeps(agent, 3)
    view = read_page(status_html(status_json(agent)))
    assert view.rows_with(busy, "busy: timeout, still generating")
    assert view.tiles["Healthy"] == "3/3" and "All 3 workers healthy and in rotation." in view.text


def test_a_worker_drained_by_hand_is_draining_and_the_banner_says_who_drained_it(tmp_path):
    fake = FakeFleet(hung=set())
    fake.draining.add("http://w0")                 # an operator's POST /admin/drain
    agent = make_agent(tmp_path, fake)
    sweeps(agent, 2)
    view = read_page(status_html(status_json(agent)))
    assert view.tiles["Draining"] == "1" and view.tiles["In rotation"] == "2/3"
    assert "2 of 3 workers in rotation. http://w0: drained by the operator." in view.text
    assert view.rows_with("http://w0", "observe", "draining")


def test_every_string_on_the_page_is_escaped(tmp_path):
    evil = 'http://x/"><script>alert(1)</script>'
    agent = make_agent(tmp_path, FakeFleet(hung={"http://x"}, urls=[*URLS, evil]))   # it hangs
    sweeps(agent, 4)
    page = status_html(status_json(agent))
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    view = read_page(page)
    assert view.rows_with(evil)                  # shown as text, in its own row
    assert any(r[2] == evil for r in view.rows if r[1].startswith("suspect"))
