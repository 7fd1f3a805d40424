"""The KV slot reuse race of issue 14, deterministic, on a real (tiny) model: with the abort handshake skipped a late write corrupts another request's output; with it, never. Plus PD parity with colocated serving on the same model.

Six steps, driven by fault points and a hand-moved clock (no sleeps):
1. request 1 goes to prefill P1 and decode D; P1's writes hang in flight (pd.transfer.write hang);
2. D times out request 1 and ends it;
3. request 2 goes to P2 and D, and D preallocates pages for it;
4. P2 finishes and D decodes request 2;
5. P1's hung writes are released and land;
6. request 2's output is compared with its colocated reference.
"""
from __future__ import annotations

import random

import pytest

from radixserve.chaos.pd_faults import PDFaults
from radixserve.chaos.tier_faults import CopyFaults
from radixserve.compose import engine_hooks
from radixserve.disagg.worker import PDWorker
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.outputs import KV_CHECKSUM_ERROR
from radixserve.runner.model_runner import ModelRunner
from tests.unit.pd_helpers import FakeClock, Rig, greedy

PAGE = 4


def runner(model_dir, num_tokens: int) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(model_path=str(model_dir), page_size=PAGE,
                                                max_total_tokens=num_tokens, num_threads=1))


def pd(mode: str, model_dir, num_tokens: int, clock=None, **cfg) -> PDWorker:
    config = EngineConfig(model_path=str(model_dir), page_size=PAGE, max_total_tokens=num_tokens,
                          num_threads=1, chunked_prefill_size=64, disaggregation_mode=mode,
                          disaggregation_bootstrap_port=0, disaggregation_chunk_pages=1,
                          disaggregation_transfer_timeout=5.0, **cfg)
    kwargs = {"clock": clock} if clock is not None else {}
    engine = PDWorker(config, ModelRunner.from_config(config), hooks=engine_hooks(config), **kwargs)
    engine.faults = PDFaults(config.random_seed)
    return engine


def colocated(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model_path=str(model_dir), page_size=PAGE, num_threads=1,
                                 max_total_tokens=4096), runner(model_dir, 4096))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, greedy(max_tokens))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"c{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("skip_handshake,checksum", [(True, False), (False, False), (True, True)],
                         ids=["unsafe-skip-handshake", "handshake", "unsafe-skip-handshake-kv-checksum"])
def test_six_step_slot_reuse_race(mha_dir, skip_handshake, checksum):
    """With --enable-kv-checksum the late write is caught instead: request 2 ends with the
    checksum error, never with a full corrupted answer."""
    rng = random.Random(14)
    prompt1 = [rng.randrange(1, 384) for _ in range(10)]
    prompt2 = [rng.randrange(1, 384) for _ in range(10)]
    want2 = colocated(mha_dir, [prompt2], 6)[0]
    clock = FakeClock()
    p1, p2 = pd("prefill", mha_dir, 256), pd("prefill", mha_dir, 256)
    # D holds 4 pages: request 1 takes 3 of them, so request 2 can only get pages request 1 had.
    d = pd("decode", mha_dir, 4 * PAGE, clock=clock,
           disaggregation_unsafe_skip_abort_handshake=skip_handshake,
           enable_kv_checksum=checksum, kv_checksum_interval=1)
    rig = Rig(p1, p2, d)
    try:
        # 1. request 1: P1's writes start but hang in flight
        p1.faults.arm("pd.transfer.write", "hang")
        rig.submit(p1, d, "r1", prompt1, greedy(6), room=1)
        rig.run_until(lambda: p1.prefill.gauges()["num_writes_in_flight"] == 3, "P1's 3 writes")
        pages1 = set(d.decode.incoming[1].req.page_ids)
        # 2. D times out request 1
        clock.advance(6.0)
        rig.finish("r1")
        assert rig.finals["r1"].error_code == "kv_transfer_failed"
        # 3. request 2 arrives
        rig.submit(p2, d, "r2", prompt2, greedy(6), room=2)
        if skip_handshake:
            # 4. D reuses request 1's pages at once; P2 fills them; D decodes request 2
            rig.run_until(lambda: len(rig.tokens.get("r2", [])) >= 2, "request 2 decoding")
            assert pages1 & set(d.engine.scheduler.running[0].page_ids), "pages were not reused"
        else:
            # 4'. the pages stay quarantined: request 2 waits for pages, whatever we step
            rig.run_until(lambda: 1 in p1.prefill.rooms and p1.prefill.rooms[1].closing,
                          "P1 to learn of the abort")
            for _ in range(20):
                rig.step()
            assert d.stats()["pd"]["num_quarantined_pages"] == 3
            assert "r2" not in rig.tokens and d.decode.incoming[2].expect_s is None
        # 5. P1's in-flight writes land
        p1.faults.disarm("pd.transfer.write")
        rig.finish("r2")
        rig.idle()
        # 6. the verdict
        stats = d.stats()["pd"]
        if checksum:
            assert stats["late_writes_landed"] == 3
            assert rig.finals["r2"].error_code == KV_CHECKSUM_ERROR
            assert d.stats()["num_kv_checksum_failures"] == 1
        elif skip_handshake:
            assert stats["late_writes_landed"] == 3
            assert rig.tokens["r2"] != want2, "the late write did not corrupt request 2"
        else:
            assert stats["late_writes_landed"] == 0
            assert rig.tokens["r2"] == want2
            assert stats["num_quarantined_pages"] == 0
        for engine in (p1, p2, d):
            engine.check_invariants()
            s = engine.stats()
            assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"], s
    finally:
        rig.close()


def test_pd_parity_with_colocated(mha_dir):
    check_pd_parity_with_colocated(mha_dir)


def check_pd_parity_with_colocated(mha_dir):
    """Prompts of 1 to 33 tokens and a prefill-side prefix hit decode over PD exactly what colocated serving decodes."""
    rng = random.Random(22)
    lengths = [1, 3, 4, 5, 8, 12, 16, 17, 24, 33]
    prompts = [[rng.randrange(1, 384) for _ in range(n)] for n in lengths]
    prompts.append(prompts[-1][:16] + [5, 6, 7])   # a prefill-side prefix-cache hit
    want = colocated(mha_dir, prompts, 10)
    p, d = pd("prefill", mha_dir, 4096), pd("decode", mha_dir, 4096)
    rig = Rig(p, d)
    try:
        for i, prompt in enumerate(prompts):
            rig.submit(p, d, f"r{i}", prompt, greedy(10, logprobs=1), room=100 + i)
        rig.finish(*(f"r{i}" for i in range(len(prompts))))
        assert [rig.tokens[f"r{i}"] for i in range(len(prompts))] == want
        assert rig.finals[f"r{len(prompts) - 1}"].num_cached_tokens == 16
    finally:
        rig.close()


def test_decode_kv_pressure_with_a_host_tier_resumes_from_host(mha_dir):
    """C27, host-offload variant, on the real runner: a decode worker whose pool holds about
    two of these requests preempts under decode pressure; a preempted request's KV, evicted
    from the device meanwhile, comes back from the host tier (every layer's load delayed) when
    it resumes, and every output equals its colocated reference."""
    rng = random.Random(27)
    prompts = [[rng.randrange(1, 384) for _ in range(20)] for _ in range(8)]
    want = colocated(mha_dir, prompts, 30)
    p = pd("prefill", mha_dir, 4096)
    d = pd("decode", mha_dir, 24 * PAGE, enable_hierarchical_cache=True, hicache_ratio=8.0)
    d.runner.host_kv.fault = CopyFaults(h2d_delay_ms=1)
    rig = Rig(p, d)
    try:
        for i, prompt in enumerate(prompts):
            rig.submit(p, d, f"r{i}", prompt, greedy(30), room=500 + i)
        rig.finish(*(f"r{i}" for i in range(len(prompts))))
        assert [rig.tokens[f"r{i}"] for i in range(len(prompts))] == want
        stats = d.stats()
        assert stats["num_preemptions"] > 0 and stats["hicache_loads"] > 0, stats
        assert stats["hicache_failed_loads"] == 0
        rig.idle()
        for engine in (p, d):
            engine.check_invariants()
            s = engine.stats()
            assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"], s
        d.engine.kv.tier.check()
        assert not d.engine.kv.tier.loads and not d.engine.kv.tier.pinned
    finally:
        rig.close()
