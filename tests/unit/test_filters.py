"""Output filters on a GenerationRun: what they rewrite is what is sent and kept, a detection ends the run, and the one factory orders them."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from radixserve.engine.messages import AddReq, EngineInfo, PDTarget
from radixserve.errors import OutputAnomaly
from radixserve.outputs import EngineOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.anomaly import GuardConfig, GuardFilter, GuardSettings
from radixserve.server.confidence_guard import ConfidenceConfig
from radixserve.chaos.http_faults import Corrupter
from radixserve.server.filters import Detection
from radixserve.server.pd import with_rooms
from radixserve.server.serving import GenerationRun, ServingContext


class ScriptedStream:
    """A RequestStream whose outputs are `tokens` per engine request, one token an output."""

    def __init__(self, adds: list[AddReq], tokens: list[int]):
        self.unfinished = {a.request_id for a in adds}
        self.outputs = [EngineOutput(a.request_id, [t], finished=k == len(tokens) - 1,
                                     finish_reason="length" if k == len(tokens) - 1 else None)
                        for a in adds for k, t in enumerate(tokens)]
        self.closed = False

    async def accepted(self) -> None:
        pass

    async def get(self) -> EngineOutput:
        out = self.outputs.pop(0)
        if out.finished:
            self.unfinished.discard(out.request_id)
        return out

    def abort(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    def close(self) -> None:
        self.closed = True


def context(tokenizer, tokens: list[int]) -> ServingContext:
    client = SimpleNamespace(info=EngineInfo(max_context_len=256, page_size=16),
                             submit=lambda adds: ScriptedStream(adds, tokens))
    return ServingContext(client, tokenizer, "m", "m", max_open_requests=4)


class Shout:
    """An OutputFilter that upper-cases every update and records the indexes it saw."""

    def __init__(self):
        self.seen: list[int] = []

    def feed(self, index, update):
        self.seen.append(index)
        update.text = update.text.upper()


async def stream_and_collect(ctx: ServingContext, filters) -> tuple[dict[int, str], list[str]]:
    ctx.filters_for = lambda params, report: (filters(), params)
    prompts = [[1], [1]]
    sent: dict[int, str] = {}
    async with GenerationRun(ctx, "r", prompts, SamplingParams(n=2, max_tokens=8)) as run:
        async for index, u in run.updates():
            sent[index] = sent.get(index, "") + u.text
    async with GenerationRun(ctx, "r", prompts, SamplingParams(n=2, max_tokens=8)) as run:
        results = await run.results()
    return sent, [c.text for r in results for c in r.outputs]


def test_rewritten_text_is_what_is_sent_and_kept(default_tokenizer):
    """Streamed deltas and the full response agree byte for byte, a filter's rewrite included;
    filters see choices numbered over the run (prompt i, choice j -> i * n + j)."""
    shout = Shout()
    ctx = context(default_tokenizer, default_tokenizer.encode(" hello there"))
    sent, full = asyncio.run(stream_and_collect(ctx, lambda: [shout]))
    assert [sent[i] for i in range(4)] == full == [" HELLO THERE"] * 4
    assert set(shout.seen) == {0, 1, 2, 3}


def test_a_detection_aborts_its_choice_and_ends_the_run(default_tokenizer):
    class Trip:
        def feed(self, index, update):
            return Detection("rare_chars", "planted") if index == 1 else None

    async def run_it() -> list[tuple[int, str | None]]:
        seen = []
        ctx = context(default_tokenizer, default_tokenizer.encode(" a b"))
        ctx.filters_for = lambda params, report: ([Trip()], params)
        run = GenerationRun(ctx, "r", [[1]], SamplingParams(n=2, max_tokens=8))
        with pytest.raises(OutputAnomaly) as err:
            async with run:
                async for index, u in run.updates():
                    seen.append((index, u.finish_reason))
        assert err.value.code == "output_anomaly" and "rare_chars: planted" in str(err.value)
        assert run.stream.closed
        return seen

    seen = asyncio.run(run_it())
    assert seen[-1] == (1, "abort") and all(i == 0 for i, _ in seen[:-1])


def test_the_factory_runs_the_corrupter_before_the_guard_and_arms_confidence(default_tokenizer):
    ctx = context(default_tokenizer, [])
    assert ctx.filters_for(SamplingParams()) == ([], SamplingParams())
    ctx.guard = GuardSettings(GuardConfig(), confidence=ConfidenceConfig())
    corrupter = Corrupter("noise", random.Random(0))
    ctx.faults = SimpleNamespace(corrupter=lambda: corrupter)
    filters, params = ctx.filters_for(SamplingParams(temperature=0.0))
    assert filters[0] is corrupter and isinstance(filters[1], GuardFilter) and len(filters) == 2
    assert params.guard_confidence
    hot = ctx.filters_for(SamplingParams(temperature=1.5))[1]
    assert not hot.guard_confidence   # too hot to judge: the engine need not report confidences


def test_pd_rooms_follow_the_engine_request_order():
    params = SamplingParams()
    adds = [AddReq(f"r-{k}", [1], params) for k in range(3)]
    rooms = with_rooms(adds, PDTarget("h", 9, (1 << 63) - 2))
    assert [a.pd.room for a in rooms] == [(1 << 63) - 2, (1 << 63) - 1, 0]
    assert {(a.pd.bootstrap_host, a.pd.bootstrap_port) for a in rooms} == {("h", 9)}
