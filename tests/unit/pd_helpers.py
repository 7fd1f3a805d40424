"""Two-engine PD rigs for unit tests: prefill and decode PDWorkers over the fake runner, on loopback TCP, stepped by hand."""
from __future__ import annotations

import time

from radixserve.chaos.pd_faults import PDFaults
from radixserve.disagg.protocol import PDTarget
from radixserve.disagg.worker import PDWorker
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeHostKV, FakeRunner

VOCAB = 1000
HANG_GUARD_S = 30.0   # a driver loop that runs this long has hung: fail (never a timing assertion)


class FakeClock:
    """A clock tests move by hand, so timeouts fire exactly when a test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pd_engine(mode: str, num_pages: int = 64, page_size: int = 4, clock=None, host_pages: int = 0,
              **cfg) -> PDWorker:
    """A PDWorker over the fake runner; `host_pages` > 0 adds a host KV tier of that many pages."""
    cfg.setdefault("chunked_prefill_size", 32)
    cfg.setdefault("disaggregation_chunk_pages", 2)
    config = EngineConfig(page_size=page_size, disaggregation_mode=mode,
                          disaggregation_bootstrap_port=0, **cfg)
    runner = FakeRunner(num_pages, page_size, VOCAB, 4096)
    if host_pages:
        runner.host_kv = FakeHostKV(runner, host_pages)
    engine = PDWorker(config, runner, clock=clock or time.monotonic)
    engine.faults = PDFaults(config.random_seed)   # armed by the tests (`faults.arm`)
    return engine


def target(prefill: PDWorker, room: int) -> PDTarget:
    port = int(prefill.bootstrap_address.rsplit(":", 1)[1])
    return PDTarget("127.0.0.1", port, room)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


class Rig:
    """Engines stepped round-robin; outputs gathered per request id."""

    def __init__(self, *engines: PDWorker):
        self.engines = engines
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict = {}

    def submit(self, prefill: PDWorker, decode: PDWorker, rid: str, prompt: list[int],
               params: SamplingParams, room: int) -> None:
        prefill.add_request(f"p-{rid}", prompt, params, target(prefill, room))
        decode.add_request(rid, prompt, params, target(prefill, room))

    def step(self) -> None:
        for engine in self.engines:
            for out in engine.step():
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    self.finals[out.request_id] = out
            engine.check_invariants()

    def run_until(self, done, what: str = "condition") -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not done():
            assert time.monotonic() < deadline, f"hung waiting for {what}"
            self.step()

    def finish(self, *rids: str) -> None:
        self.run_until(lambda: all(r in self.finals for r in rids), f"{rids} to finish")

    def idle(self) -> None:
        self.run_until(lambda: not any(e.has_unfinished() for e in self.engines), "idle")

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
