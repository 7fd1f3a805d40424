"""Run the count gate's request sets through the real Engine over the fake runner; return exact counts.

Why the fake runner (tests/unit/fake_runner.py) and not a tiny random-weight model: every count
here is a scheduler and prefix-cache count, decided by token ids and lengths alone. The fake
model's next token is a hash of the context it reads back through the page table, so outputs are
the same on every machine, thread count and BLAS build (a random-weight model's greedy argmax
sits near ties and can flip between them, which would change multi-turn prompts and EOS points
and make the gate flaky), a KV mix-up still trips its assertions, and a run takes about a second.

The driver is a step clock, not a wall clock: step t submits every request whose arrival step is
<= t (in arrival order), then calls `Engine.step()` once; an idle step runs nothing.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams
from tests.regression.workload import (EOS_ID, VOCAB_SIZE, Conversation, agent_repos, mixed,
                                       multi_turn, random_prompts, shared_prefix)
from tests.unit.fake_runner import FakeHostKV, FakeRunner

PAGE_SIZE = 8
EOS_EVERY = 40           # the fake model ends an answer early about once in 40 tokens
MAX_STEPS = 100_000      # a driver that runs this long is stuck: fail instead of hanging CI

# metric -> "higher" / "lower" (is better), or "same": a property of the request set itself,
# which no scheduler change may move (if it does, the run is not comparable with the baseline).
METRICS = {
    "num_requests": "same", "num_prompt_tokens": "same", "num_generated_tokens": "same",
    "num_cached_tokens": "higher", "cache_hit_rate": "higher",
    "num_prompt_tokens_computed": "lower", "num_computed_tokens": "lower",
    "num_steps": "lower", "generated_tokens_per_step": "higher", "mean_ttft_steps": "lower",
    "num_preemptions": "lower", "num_evicted_pages": "lower",
}


@dataclass(frozen=True, slots=True)
class Scenario:
    """A request set and the KV budget it runs under (`num_pages` pages of PAGE_SIZE tokens;
    `host_pages` > 0: with a host KV tier of that many pages)."""

    name: str
    conversations: Callable[[], list[Conversation]]
    num_pages: int
    host_pages: int = 0


# Budgets are small on purpose: every set evicts, shared_prefix, random and mixed also preempt.
SCENARIOS = (
    Scenario("multi_turn", multi_turn, 96),
    Scenario("shared_prefix", shared_prefix, 48),
    Scenario("random", random_prompts, 48),
    Scenario("mixed", mixed, 88),
    # a working set (~230 pages) four times the device pool, all of it fitting in host memory
    Scenario("agent_repos_host_tier", agent_repos, 56, host_pages=256),
)
ENGINE_CONFIG = {"page_size": PAGE_SIZE, "chunked_prefill_size": 64, "max_running_requests": 8}


def run_scenario(scenario: Scenario, **config_overrides) -> dict[str, int | float]:
    """Drive one request set to the end and return its counts, keyed and ordered as METRICS.
    `config_overrides` replace ENGINE_CONFIG fields (e.g. disable_radix_cache=True). Raises
    AssertionError when the engine breaks a page-ownership invariant or never goes idle."""
    runner = FakeRunner(scenario.num_pages, PAGE_SIZE, VOCAB_SIZE, eos=EOS_ID, eos_every=EOS_EVERY)
    if scenario.host_pages:
        runner.host_kv = FakeHostKV(runner, scenario.host_pages)
    engine = Engine(EngineConfig(**{**ENGINE_CONFIG, **config_overrides}), runner)
    order = itertools.count()
    pending = [(c.arrival_step, next(order), c, 0, ()) for c in scenario.conversations()]
    heapq.heapify(pending)
    active: dict[str, tuple[Conversation, int, tuple[int, ...], int]] = {}
    answers: dict[str, list[int]] = {}
    ttft_steps: list[int] = []
    for step in range(MAX_STEPS):
        if not pending and not engine.has_unfinished():
            break
        while pending and pending[0][0] <= step:
            _, _, conv, k, history = heapq.heappop(pending)
            prompt = history + conv.turns[k].user_ids
            request_id = f"{conv.name}.{k}"
            engine.add_request(request_id, list(prompt),
                               SamplingParams(max_tokens=conv.turns[k].max_tokens, temperature=0.0))
            active[request_id], answers[request_id] = (conv, k, prompt, step), []
        for out in engine.step():
            conv, k, prompt, arrival = active[out.request_id]
            if out.new_token_ids and not answers[out.request_id]:
                ttft_steps.append(step - arrival)
            answers[out.request_id].extend(out.new_token_ids)
            if out.finished and k + 1 < len(conv.turns):
                answer = tuple(t for t in answers[out.request_id] if t != EOS_ID)
                heapq.heappush(pending, (step + conv.think_steps, next(order), conv, k + 1,
                                         prompt + answer))
    else:
        raise AssertionError(f"{scenario.name}: engine still busy after {MAX_STEPS} steps")
    engine.check_invariants()
    return _counts(engine, runner, len(answers), ttft_steps)


def _counts(engine: Engine, runner: FakeRunner, num_requests: int,
            ttft_steps: list[int]) -> dict[str, int | float]:
    stats = engine.stats()
    seqs = [s for batch in runner.steps for s in batch]
    num_steps = len(runner.steps)
    counts = {
        "num_requests": num_requests,
        "num_prompt_tokens": stats["num_prompt_tokens"],
        "num_generated_tokens": stats["num_generated_tokens"],
        "num_cached_tokens": stats["num_cached_tokens"],
        "cache_hit_rate": round(stats["cache_hit_rate"], 6),
        # prompt positions whose KV was computed (recomputes after preemption included)
        "num_prompt_tokens_computed": sum(
            max(0, min(s.start_pos + len(s.input_ids), len(s.prompt_ids)) - s.start_pos) for s in seqs),
        "num_computed_tokens": sum(len(s.input_ids) for s in seqs),
        "num_steps": num_steps,
        "generated_tokens_per_step": round(stats["num_generated_tokens"] / max(num_steps, 1), 6),
        "mean_ttft_steps": round(sum(ttft_steps) / max(len(ttft_steps), 1), 6),
        "num_preemptions": stats["num_preemptions"],
        "num_evicted_pages": engine.kv.cache.num_evicted_pages,
    }
    assert list(counts) == list(METRICS), "counts and METRICS disagree"
    return counts


def run_all(**config_overrides) -> dict[str, dict[str, int | float]]:
    """Counts of every scenario, keyed by scenario name (see run_scenario)."""
    return {s.name: run_scenario(s, **config_overrides) for s in SCENARIOS}
