"""The abort/ack handshake over the fake runner: every way a request ends early keeps its decode pages until the prefill side says safe-to-free; late writes are refused and counted; decode KV pressure neither crashes nor starves (C27)."""
from __future__ import annotations

import random

import pytest

from tests.unit.pd_helpers import FakeClock, Rig, greedy, pd_engine
from tests.unit.test_engine import reference

VOCAB = 1000


def quarantined(d) -> int:
    return d.stats()["pd"]["num_quarantined_pages"]


def assert_idle(*engines):
    for e in engines:
        e.check_invariants()
        s = e.stats()
        assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"], s
        assert s["pd"]["num_quarantined_pages"] == 0 and s["pd"]["num_bootstrapping"] == 0


def test_decode_abort_with_writes_in_flight_waits_for_the_ack():
    p, d = pd_engine("prefill"), pd_engine("decode")
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.transfer.write", "hang")
        rig.submit(p, d, "a", list(range(20)), greedy(4), room=1)
        rig.run_until(lambda: p.prefill.gauges()["num_writes_in_flight"] > 0, "a write in flight")
        d.abort("a")                      # the client left (or /abort_request on decode)
        rig.run_until(lambda: p.prefill.rooms[1].closing == "abort", "prefill learns of it")
        for _ in range(10):
            rig.step()
        assert quarantined(d) == 5        # 20 tokens / 4: still held, a write may land there
        p.faults.disarm()
        rig.idle()
        assert quarantined(d) == 0
        assert d.stats()["pd"]["transfers_aborted"] == 1
        assert_idle(p, d)
    finally:
        rig.close()


def test_late_write_lands_after_the_abort_into_quarantined_pages():
    p, d = pd_engine("prefill"), pd_engine("decode")
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.transfer.write", "late", count=1)
        rig.submit(p, d, "a", list(range(12)), greedy(4), room=2)
        rig.run_until(lambda: p.prefill.gauges()["num_writes_in_flight"] == 1, "the late write")
        d.abort("a")
        rig.idle()
        stats = d.stats()["pd"]
        assert stats["late_writes_landed"] == 0 and stats["late_writes_refused"] == 0
        assert_idle(p, d)
        rig.submit(p, d, "b", list(range(12)), greedy(4), room=3)   # the same pages, clean
        rig.finish("b")
        assert rig.tokens["b"] == reference(list(range(12)), 4)
    finally:
        rig.close()


def test_writes_after_the_abort_never_start():
    # A long prompt prefills over several steps; the abort comes after the first chunk.
    p = pd_engine("prefill", chunked_prefill_size=8)
    d = pd_engine("decode")
    rig = Rig(p, d)
    try:
        rig.submit(p, d, "a", list(range(40)), greedy(4), room=4)
        rig.run_until(lambda: p.pd_stats.counters["transfer_bytes"] > 0, "first write")
        d.abort("a")
        rig.idle()
        assert p.stats()["pd"]["transfers_aborted"] == 1
        assert p.engine.requests == {} and "p-a" in rig.finals
        assert p.prefill.rooms[4].num_writes < 5      # 10 pages in writes of 2: not all sent
        assert_idle(p, d)
    finally:
        rig.close()


def test_prefill_abort_reaches_decode_as_error():
    p, d = pd_engine("prefill"), pd_engine("decode")
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.prefill.start", "hang")
        rig.submit(p, d, "a", list(range(9)), greedy(4), room=5)
        rig.run_until(lambda: d.stats()["pd"]["num_waiting_for_kv"] == 1
                      and p.prefill.rooms[5].peer is not None, "both legs bootstrapped")
        p.abort("p-a")                    # /abort_request or client gone on the prefill leg
        rig.finish("a")
        assert rig.finals["a"].error_code == "kv_transfer_failed"
        assert "aborted" in rig.finals["a"].error
        rig.idle()
        assert_idle(p, d)
    finally:
        rig.close()


def test_unsafe_switch_frees_at_once_and_lands_late_writes_blindly():
    p, d = pd_engine("prefill"), pd_engine("decode", disaggregation_unsafe_skip_abort_handshake=True)
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.transfer.write", "hang")
        rig.submit(p, d, "a", list(range(8)), greedy(4), room=6)
        rig.run_until(lambda: p.prefill.gauges()["num_writes_in_flight"] == 1, "write in flight")
        d.abort("a")
        assert quarantined(d) == 0        # freed at once: the race window is open
        p.faults.disarm()
        rig.idle()
        assert d.stats()["pd"]["late_writes_landed"] == 1
    finally:
        rig.close()


@pytest.mark.parametrize("host_pages", [0, 400], ids=["no-host-tier", "host-tier"])
def test_decode_kv_pressure_neither_crashes_nor_starves(host_pages):
    # Decode holds 40 pages of 4 tokens; 12 requests of 20-token prompts each want 5 pages
    # for the prompt and 8 more for 30 output tokens, so decoding preempts and preallocation
    # waits; some preallocations are delayed so that several sit preallocated at once.
    # With a host tier (C27's offload variant) a preempted request's KV, evicted from the
    # device meanwhile, comes back from the host when it resumes.
    p, d = pd_engine("prefill", num_pages=512), pd_engine("decode", num_pages=40, host_pages=host_pages)
    d.faults.arm("pd.decode.prealloc", "delay", delay_ms=1, delay_max_ms=20, probability=0.5)
    rig = Rig(p, d)
    try:
        rng = random.Random(27)
        prompts = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(12)]
        for i, prompt in enumerate(prompts):
            rig.submit(p, d, f"r{i}", prompt, greedy(30), room=300 + i)
        rig.finish(*(f"r{i}" for i in range(12)))
        for i, prompt in enumerate(prompts):
            assert rig.tokens[f"r{i}"] == reference(prompt, 30), i
        stats = d.stats()
        assert stats["num_preemptions"] > 0
        if host_pages:
            assert stats["hicache_loads"] > 0 and stats["hicache_failed_loads"] == 0, stats
        rig.idle()
        assert_idle(p, d)
        if host_pages:
            d.engine.kv.tier.check()
            assert not d.engine.kv.tier.loads and not d.engine.kv.tier.pinned
    finally:
        rig.close()


def test_writes_after_the_quarantine_expired_are_refused_and_counted():
    clock = FakeClock()
    p = pd_engine("prefill", clock=clock)
    d = pd_engine("decode", clock=clock, disaggregation_transfer_timeout=1.0)
    rig = Rig(p, d)
    try:
        p.faults.arm("pd.transfer.write", "hang")
        rig.submit(p, d, "a", list(range(8)), greedy(4), room=8)
        rig.run_until(lambda: p.prefill.gauges()["num_writes_in_flight"] == 1, "write in flight")
        d.abort("a")
        rig.step()
        assert quarantined(d) == 2
        clock.advance(10.0)               # the prefill side never answers: give the pages up
        rig.step()
        assert quarantined(d) == 0
        p.faults.disarm()
        rig.run_until(lambda: d.stats()["pd"]["late_writes_refused"] == 1, "the refusal")
        assert d.stats()["pd"]["late_writes_landed"] == 0
    finally:
        rig.close()
