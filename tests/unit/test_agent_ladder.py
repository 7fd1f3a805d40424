"""The agent's ladder: confirmation, drain vs restart vs isolate, hysteresis, escalating ejection, share cap, panic, policy steps."""
from __future__ import annotations

from radixserve.agent.config import LadderConfig
from radixserve.agent.ladder import FleetView, Ladder
from radixserve.agent.rules import Finding

URLS = ("http://w0", "http://w1", "http://w2")
CFG = LadderConfig(base_ejection_s=30, max_ejection_s=300, drain_timeout_s=10,
                   policy_cooldown_s=60)


def view(responsive=URLS, **kw):
    return FleetView(urls=kw.pop("urls", URLS), responsive=frozenset(responsive), **kw)


def f(kind, url="http://w0"):
    return Finding(kind, url, f"{kind} on {url}")


def acts(decisions):
    return [(d.action, d.worker) for d in decisions if d.acts]


def run(ladder, sweeps, start=0.0, dt=5.0, **kw):
    """Step `sweeps` (a list of finding lists) with one view; returns all decisions."""
    out = []
    for i, found in enumerate(sweeps):
        out += ladder.step(start + i * dt, kw.get("v") or view(), found)
    return out


def test_a_finding_on_one_sweep_is_suspected_then_cleared():
    ladder = Ladder(CFG)
    out = run(ladder, [[f("ttft_outlier")], [], [], []])
    assert acts(out) == []
    assert [d.action for d in out] == ["suspect", "clear"]
    assert ladder.tracks["http://w0"].state == "observe"


def test_slow_worker_is_drained_not_restarted_and_returns_when_probes_pass():
    ladder = Ladder(CFG)
    sup = frozenset(URLS)
    out = run(ladder, [[f("itl_outlier")]] * 2, v=view(supervised=sup))
    assert acts(out) == [("drain", "http://w0")]
    assert ladder.wants_probe() == {"http://w0"}
    out = run(ladder, [[], [], []], start=10, v=view(supervised=sup))
    assert acts(out) == []  # no restart however long it waits
    out = ladder.step(30, view(supervised=sup, recovered=frozenset({"http://w0"})), [])
    assert acts(out) == [("undrain", "http://w0")]
    run(ladder, [[], [], []], start=35)
    assert ladder.tracks["http://w0"].state == "observe"


def test_hung_supervised_worker_is_drained_then_restarted_then_returned():
    ladder = Ladder(CFG)
    sup = frozenset(URLS)
    hung = view(responsive=URLS[1:], supervised=sup, in_flight={"http://w0": 2})
    out = run(ladder, [[f("unresponsive")]] * 2, v=hung)
    assert acts(out) == [("drain", "http://w0")]
    out = ladder.step(10, hung, [f("unresponsive")])
    assert acts(out) == [] and "2 requests are in flight" in out[0].reason
    out = ladder.step(15, hung, [f("unresponsive")])   # drain_timeout_s passed
    assert acts(out) == [("restart", "http://w0")]
    assert acts(ladder.step(20, hung, [])) == []      # not answering yet
    assert acts(ladder.step(25, view(supervised=sup), [])) == [("undrain", "http://w0")]


def test_a_restarted_repeat_offender_stays_out_longer():
    ladder = Ladder(CFG)
    sup = frozenset(URLS)
    hung = view(responsive=URLS[1:], supervised=sup)
    now = 0.0
    for n in (1, 2, 3):
        out = run(ladder, [[f("unresponsive")]] * 3, start=now, v=hung)
        assert acts(out) == [("drain", "http://w0"), ("restart", "http://w0")]
        restarted_at = now + 10
        hold = 0 if n == 1 else 30 * (n - 1)
        assert ladder.tracks["http://w0"].out_until == restarted_at + hold
        now = restarted_at + hold
        assert acts(ladder.step(now, view(supervised=sup), [])) == [("undrain", "http://w0")]
        now += 5


def test_hung_worker_without_supervision_is_isolated_for_the_ejection_time():
    ladder = Ladder(CFG)
    out = run(ladder, [[f("unresponsive")]] * 2, v=view(responsive=URLS[1:]))
    assert acts(out) == [("isolate", "http://w0")]
    assert acts(ladder.step(20, view(), [])) == []     # healthy, but 30 s not over
    assert acts(ladder.step(40, view(), [])) == [("undrain", "http://w0")]


def test_errors_on_two_of_three_isolate_at_most_the_allowed_share():
    ladder = Ladder(CFG)   # 10% of 3 -> at least one
    found = [f("error_rate", "http://w0"), f("error_rate", "http://w1")]
    out = run(ladder, [found] * 4)
    assert acts(out) == [("isolate", "http://w0")] or acts(out) == [("isolate", "http://w1")]
    assert any("max share" in d.reason for d in out if d.action == "none")
    states = sorted(t.state for t in ladder.tracks.values())
    assert states.count("isolated") == 1


def test_panic_below_half_answering_alerts_instead_of_acting():
    ladder = Ladder(CFG)
    found = [f("unresponsive", "http://w0"), f("unresponsive", "http://w1")]
    out = run(ladder, [found] * 4, v=view(responsive=("http://w2",), supervised=frozenset(URLS)))
    assert acts(out) == []
    alerts = [d for d in out if d.action == "alert"]
    assert alerts and "panic" in alerts[0].reason
    out = ladder.step(30, view(supervised=frozenset(URLS)), [])
    assert any("panic over" in d.reason for d in out)


def test_repeat_offender_ejection_time_escalates_and_is_capped():
    ladder = Ladder(CFG)
    now = 0.0
    for n in range(1, 13):
        run(ladder, [[f("error_rate")]] * 2, start=now)
        t = ladder.tracks["http://w0"]
        assert t.state == "isolated"
        assert t.out_until - (now + 5) == min(30 * n, 300)
        now = t.out_until
        assert acts(ladder.step(now, view(), [])) == [("undrain", "http://w0")]
        now += 5


def test_one_new_action_per_sweep():
    ladder = Ladder(LadderConfig(max_ejection_share=1.0))
    found = [f("ttft_outlier", u) for u in URLS[:2]]
    out = run(ladder, [found] * 2)
    assert len(acts(out)) == 1
    assert any("one new action per sweep" in d.reason for d in out)
    assert len(acts(ladder.step(10, view(), found))) == 1


def test_hit_rate_collapse_alone_is_watched_not_acted_on():
    ladder = Ladder(CFG)
    out = run(ladder, [[f("hit_rate_collapsed")]] * 4)
    assert acts(out) == [] and len(out) == 1 and "watched" in out[0].reason


def test_leak_without_supervision_alerts_once():
    ladder = Ladder(CFG)
    out = run(ladder, [[f("memory_growth")]] * 6)
    assert acts(out) == []
    assert [d.action for d in out].count("alert") == 1


def test_policy_steps_with_cooldown_and_limits():
    ladder = Ladder(CFG)
    policy = {"cache_threshold": 0.3}
    spread = Finding("fleet_ttft_spread", None, "spread")
    out = ladder.step(0, view(policy=policy), [spread])
    assert out[0].action == "set_policy_params" and out[0].params == {"cache_threshold": 0.4}
    out = ladder.step(5, view(policy={"cache_threshold": 0.4}), [spread])
    assert acts(out) == [] and "cooldown" in out[0].reason
    collapse = Finding("fleet_hit_rate_collapsed", None, "collapse")
    out = ladder.step(100, view(policy={"cache_threshold": 0.1}), [collapse])
    assert acts(out) == [] and "limit" in out[0].reason
    out = ladder.step(200, view(policy={"cache_threshold": 0.4}), [collapse])
    assert out[0].params == {"cache_threshold": 0.3}
    rr = ladder.step(400, view(policy={"policy": "round_robin", "cache_threshold": 0.3}), [collapse])
    assert acts(rr) == [] and "round_robin" in rr[0].reason


def test_undo_restores_the_state_when_the_action_failed():
    ladder = Ladder(CFG)
    out = run(ladder, [[f("ttft_outlier")]] * 2)
    drain = next(d for d in out if d.action == "drain")
    ladder.undo(drain)
    assert ladder.tracks["http://w0"].state == "suspect"
    assert acts(ladder.step(10, view(), [f("ttft_outlier")])) == [("drain", "http://w0")]


def test_a_drained_slow_worker_that_stops_answering_is_restarted_or_isolated():
    for supervised, action in ((frozenset(URLS), "restart"), (frozenset(), "isolate")):
        ladder = Ladder(CFG)
        run(ladder, [[f("itl_outlier")]] * 2, v=view(supervised=supervised))
        hung = view(responsive=URLS[1:], supervised=supervised)
        out = run(ladder, [[f("unresponsive")]] * 2, start=10, v=hung)
        assert acts(out) == [(action, "http://w0")]


def test_an_adopted_worker_is_isolated_and_returns_by_the_isolation_path():
    """A new agent's start-up: w0 drained at the router by an earlier agent is held out for one
    ejection (30 s), counts towards the share cap, and returns only after an ejection at whose
    end /health answers."""
    ladder = Ladder(CFG)
    out = ladder.adopt(0.0, ["http://w0"])
    assert [(d.action, d.worker, d.state_to) for d in out] == [("adopt", "http://w0", "isolated")]
    t = ladder.tracks["http://w0"]
    assert (t.state, t.ejections, t.out_until) == ("isolated", 1, 30.0)
    found = [f("error_rate", "http://w1")]
    out = run(ladder, [found] * 3)                  # t = 0, 5, 10: w0 answers, ejection not over
    assert acts(out) == [] and any("max share" in d.reason for d in out)
    assert acts(ladder.step(30, view(responsive=URLS[1:]), [])) == []   # over, /health fails:
    assert ladder.tracks["http://w0"].out_until == 60.0                  # one ejection more
    assert acts(ladder.step(55, view(), [])) == []
    assert acts(ladder.step(60, view(), [])) == [("undrain", "http://w0")]
    assert ladder.tracks["http://w0"].state == "reintegrating"


def test_a_worker_the_operator_drained_is_never_acted_on():
    ladder = Ladder(CFG)
    sup = frozenset(URLS)
    held = view(responsive=URLS[1:], supervised=sup, operator_drained=frozenset({"http://w0"}))
    out = run(ladder, [[f("unresponsive")]] * 4, v=held)
    assert acts(out) == []
    assert any("the operator drained it" in d.reason for d in out if d.action == "none")
    undrained = view(responsive=URLS[1:], supervised=sup)   # the operator returned it, still hung
    assert acts(ladder.step(20, undrained, [f("unresponsive")])) == [("drain", "http://w0")]


def test_a_worker_the_agent_holds_out_and_the_operator_drains_is_left_to_the_operator():
    ladder = Ladder(CFG)
    hung = view(responsive=URLS[1:])
    assert acts(run(ladder, [[f("unresponsive")]] * 2, v=hung)) == [("isolate", "http://w0")]
    taken = view(operator_drained=frozenset({"http://w0"}))   # answers again, the operator's now
    assert acts(ladder.step(100, taken, [])) == []              # past the ejection: no undrain
    assert ladder.tracks["http://w0"].state == "observe"
    assert acts(ladder.step(105, taken, [f("unresponsive")] * 2)) == []
    assert acts(ladder.step(110, taken, [f("unresponsive")])) == []
