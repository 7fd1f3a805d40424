"""Runner factories for API tests that need no model: the scripted FakeRunner, plus ones that crash, fail to load or hang."""
from __future__ import annotations

import os
import time

from radixserve.engine.runner_api import ScheduledSeq, SeqResult
from radixserve.engine_config import EngineConfig
from tests.unit.fake_runner import FakeRunner

FAKE_VOCAB = 1000
FAKE_CONTEXT = 512
WEDGE_TOKEN = 999


def fake_runner(config: EngineConfig) -> FakeRunner:
    """FakeRunner: 256 pages, vocab 1000, context 512, no eos of its own."""
    return FakeRunner(num_pages=256, page_size=config.page_size, vocab_size=FAKE_VOCAB,
                      max_context_len=FAKE_CONTEXT)


class _CrashingRunner(FakeRunner):
    """run() raises on its second call: exercises the fatal path."""

    num_runs = 0

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        self.num_runs += 1
        if self.num_runs > 1:
            raise RuntimeError("injected engine failure")
        return super().run(batch)


class _WedgingRunner(FakeRunner):
    """run() never returns once a sequence whose prompt starts with WEDGE_TOKEN is in the
    batch: a forward pass that hangs (the watchdog's case)."""

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        if any(s.prompt_ids[:1] == [WEDGE_TOKEN] for s in batch):
            while True:
                time.sleep(1)
        return super().run(batch)


def crashing_runner(config: EngineConfig) -> FakeRunner:
    return _CrashingRunner(256, config.page_size, FAKE_VOCAB, FAKE_CONTEXT)


def wedging_runner(config: EngineConfig) -> FakeRunner:
    return _WedgingRunner(256, config.page_size, FAKE_VOCAB, FAKE_CONTEXT)


def failing_runner(config: EngineConfig) -> FakeRunner:
    """Fails while loading, like a missing model file."""
    raise FileNotFoundError(os.path.join("/nonexistent", "model.gguf"))


def refusing_runner(config: EngineConfig) -> FakeRunner:
    """Refuses a setting while loading, as the model does a bad RADIXSERVE_SINGLE_ROW_PATH."""
    raise ValueError("RADIXSERVE_SINGLE_ROW_PATH='bogus': expected one of ('split', 'linear', 'packed')")
