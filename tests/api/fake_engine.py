"""Engine builders for API tests that need no model: the real Engine over the scripted FakeRunner."""
from __future__ import annotations

import os

from radixserve.config import EngineConfig
from radixserve.engine.messages import EngineInfo

FAKE_VOCAB = 1000
FAKE_CONTEXT = 512


def build_fake_engine(config: EngineConfig):
    """Engine over FakeRunner: 256 pages, vocab 1000, context 512, no eos."""
    from radixserve.engine.engine import Engine
    from tests.unit.fake_runner import FakeRunner

    runner = FakeRunner(num_pages=256, page_size=config.page_size, vocab_size=FAKE_VOCAB,
                        max_context_len=FAKE_CONTEXT)
    engine = Engine(config, runner)
    info = EngineInfo(max_context_len=engine.max_request_tokens, vocab_size=FAKE_VOCAB,
                      eos_token_ids=[], page_size=config.page_size, load_s=0.0)
    return engine, info


def build_crashing_engine(config: EngineConfig):
    """Engine whose step() raises after the first call: exercises the fatal path."""
    engine, info = build_fake_engine(config)
    real_step = engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("injected engine failure")
        return real_step()

    engine.step = step
    return engine, info


def build_failing_engine(config: EngineConfig):
    """Builder that fails while loading, like a missing model file."""
    raise FileNotFoundError(os.path.join("/nonexistent", "model.gguf"))



WEDGE_TOKEN = 999


def build_wedging_engine(config: EngineConfig):
    """Engine whose step() never returns once a request whose prompt starts with WEDGE_TOKEN is
    running: a forward pass that hangs (the watchdog's case)."""
    import time

    engine, info = build_fake_engine(config)
    real_step = engine.step

    def step():
        if any(r.prompt_ids[:1] == [WEDGE_TOKEN] for r in engine.requests.values()):
            while True:
                time.sleep(1)
        return real_step()

    engine.step = step
    return engine, info
