"""benchmarks/spec_anomaly.py's read-before-ready phase: KV pages read while the host tier's load of them is in flight.

An engine with the radix cache and the host KV tier (--enable-hierarchical-cache) and a device pool too small for the
workload's long shared preambles serves `num` requests (spec_anomaly's mix, each behind one of PREAMBLES preambles, in
turn, so a preamble is evicted to the host tier and loaded back before its next use) twice: clean, then with
`hicache.h2d.layer` armed with skip_wait "all" (the forward reads every layer without waiting for its load; the
fault point of docs/hicache.md). A request counts as corrupted when its faulted output differs from its clean one
(same seed; outputs with the readiness wait equal the tier-off ones: benchmarks/dsa_race_soak.py). The damage is in
the prompt's KV, so its hit is at generated token 0."""
from __future__ import annotations

import random

PREAMBLES = 12
NOTES = ["{t} has a long history, and many books describe how people first studied it.",
         "Students often ask how {t} works, and teachers answer with simple examples.",
         "Experts disagree about some details of {t}, but the main ideas are well known.",
         "Museums and libraries keep records about {t} that anyone can visit.",
         "In recent years, new research on {t} has changed what scientists believe."]


def preamble(rng: random.Random, topics: list[str], index: int) -> str:
    """A system prompt of about 400 tokens: reference notes on eight topics."""
    picked = rng.sample(topics, 8)
    notes = "\n".join(f"- {t}: " + " ".join(n.format(t=t) for n in NOTES) for t in picked)
    return (f"You are assistant number {index} of a public library's help desk. Answer the visitor's question "
            f"helpfully and briefly. Reference notes:\n{notes}")


def items(workload_items: list, topics: list[str]) -> list:
    """spec_anomaly's (category, conversation, params) items, each behind preamble i % PREAMBLES."""
    rng = random.Random(3)
    systems = [preamble(rng, topics, i) for i in range(PREAMBLES)]
    return [(cat, [{"role": "system", "content": systems[i % PREAMBLES]}, *conv], params)
            for i, (cat, conv, params) in enumerate(workload_items)]


def ready_traces(llm_kwargs: dict, run, with_faults, work: list, concurrency: int = 8,
                 latency_ms: float = 2.0) -> tuple[list, list]:
    """(clean, faulted) traces of `work` (items()) on a tiered engine with a 4,096-token device pool; `run` and
    `with_faults` are spec_anomaly's; every faulted trace has mode "ready" and hit_at 0. Raises AssertionError
    when no prefix came back from the host tier."""
    from radixserve import LLM

    llm = LLM(**llm_kwargs, enable_hierarchical_cache=True, hicache_ratio=8.0, max_total_tokens=4096)
    try:
        llm.faults = with_faults(llm)
        clean = run(llm, work, concurrency)
        assert llm.engine.stats()["num_cached_tokens_host"] > 0, "no prefix came back from the host tier"
        llm.faults.fault("hicache.h2d.layer", latency_ms=latency_ms, jitter_ms=latency_ms / 2, skip_wait="all")
        faulted = [dict(t, mode="ready", hit_at=0) for t in run(llm, work, concurrency)]
        llm.faults.fault("hicache.h2d.layer", clear=True)
        llm.engine.check_invariants()
    finally:
        llm.close()
    return clean, faulted
