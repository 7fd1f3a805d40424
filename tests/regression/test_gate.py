"""The count regression gate: this tree's counts against baseline.json, and proof the gate can fail."""
from __future__ import annotations

import json
import zlib

import pytest

from radixserve.engine.kv_manager import KVManager
from tests.regression import gate
from tests.regression.counts import METRICS, SCENARIOS, run_all, run_scenario

SCENARIO = {s.name: s for s in SCENARIOS}


def verdicts_of(name: str, counts: dict) -> dict[str, gate.Verdict]:
    baseline = {name: gate.load_baseline()[name]}
    return {v.metric: v for v in gate.compare(baseline, {name: counts})}


def test_counts_match_the_baseline():
    """The gate itself: any count worse than the committed baseline fails CI."""
    verdicts = gate.compare(gate.load_baseline(), run_all())
    table = gate.report(verdicts) + "\n" + gate.conclusion(verdicts)
    assert not any(v.failed for v in verdicts), "\n" + table


def test_baseline_has_every_scenario_and_metric():
    baseline = gate.load_baseline()
    assert list(baseline) == list(SCENARIO)
    assert all(list(counts) == list(METRICS) for counts in baseline.values())


def test_gate_fails_without_the_radix_cache():
    verdicts = verdicts_of("multi_turn", run_scenario(SCENARIO["multi_turn"], disable_radix_cache=True))
    assert verdicts["cache_hit_rate"].now == 0.0
    assert verdicts["cache_hit_rate"].verdict == "REGRESSED"
    assert verdicts["num_prompt_tokens_computed"].verdict == "REGRESSED"
    assert verdicts["num_prompt_tokens"].verdict == "ok"   # same requests, worse service
    assert gate.conclusion(list(verdicts.values())).startswith("REGRESSION")


@pytest.mark.parametrize("name", ["multi_turn", "shared_prefix"])
def test_gate_fails_when_a_scheduler_change_halves_the_hit_rate(monkeypatch, name):
    """The seed's case: half of the requests (a fixed half, by request id) skip the cache."""
    may_match = KVManager._may_match
    monkeypatch.setattr(KVManager, "_may_match", lambda self, req: may_match(self, req) and
                        zlib.crc32(req.request_id.encode()) % 2 == 0)
    verdicts = verdicts_of(name, run_scenario(SCENARIO[name]))
    hit_rate = verdicts["cache_hit_rate"]
    assert 0.2 * hit_rate.base < hit_rate.now < 0.8 * hit_rate.base   # about halved
    assert hit_rate.verdict == "REGRESSED" and hit_rate.failed


@pytest.mark.parametrize("direction, base, now, verdict", [
    ("lower", 5, 5, "ok"), ("lower", 5, 6, "REGRESSED"), ("lower", 5, 4, "improved"),
    ("higher", 0.5, 0.4999995, "ok"), ("higher", 0.5, 0.49, "REGRESSED"),
    ("higher", 0.5, 0.51, "improved"), ("same", 10, 11, "CHANGED"), ("same", 10, 9, "CHANGED"),
    ("lower", 5, None, "MISSING"), ("lower", None, 5, "NOT IN BASELINE"),
])
def test_judge(direction, base, now, verdict):
    assert gate.judge(direction, base, now) == verdict


CANNED = {"toy": {"num_steps": 10, "cache_hit_rate": 0.5}}


def test_command_line_update_then_gate(tmp_path, monkeypatch, capsys):
    """`--update` writes the baseline; a plain run then passes; a worse run fails with the table;
    a better run passes and asks for the refresh command."""
    path = tmp_path / "baseline.json"
    monkeypatch.setattr(gate, "run_all", lambda: CANNED)
    assert gate.main(["--update", "--baseline", str(path)]) == 0
    assert json.loads(path.read_text())["scenarios"] == CANNED
    assert gate.main(["--baseline", str(path)]) == 0
    assert "no change" in capsys.readouterr().out
    monkeypatch.setattr(gate, "run_all", lambda: {"toy": {"num_steps": 11, "cache_hit_rate": 0.5}})
    assert gate.main(["--baseline", str(path)]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if "num_steps" in line)
    assert [c.strip() for c in row.split("|")[2:-1]] == ["num_steps", "lower is better", "10", "11",
                                                        "REGRESSED"]
    monkeypatch.setattr(gate, "run_all", lambda: {"toy": {"num_steps": 9, "cache_hit_rate": 0.6}})
    assert gate.main(["--baseline", str(path)]) == 0
    assert gate.REFRESH_COMMAND in capsys.readouterr().out


def test_gate_fails_when_host_loads_go_back_to_all_or_nothing(monkeypatch):
    """The host-tier set catches a scheduler that loads a host match only when all of it fits
    the device (the behaviour before partial loads): most of the tier's hits are lost."""
    from radixserve.engine.hicache import HostTier

    start_load = HostTier.start_load
    monkeypatch.setattr(HostTier, "start_load",
                        lambda self, path, take, max_pages=None: start_load(self, path, take))
    verdicts = verdicts_of("agent_repos_host_tier", run_scenario(SCENARIO["agent_repos_host_tier"]))
    assert verdicts["cache_hit_rate"].verdict == "REGRESSED"
    assert verdicts["cache_hit_rate"].now < 0.5 * verdicts["cache_hit_rate"].base
    assert verdicts["num_prompt_tokens_computed"].verdict == "REGRESSED"
