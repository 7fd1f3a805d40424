"""Where an EAGLE verify cycle's time goes on the default model at concurrency 1, against the same engine without
speculation: per engine step, the target's forward (by tokens in the step), the draft's extend and its chain.

    PYTHONPATH=. python benchmarks/eagle_cycle.py [--prompts 4] [--max-tokens 128] [--num-steps 3]
        [--draft-min-prob P] [--draft-model-path HEAD.safetensors]

Held-out prompts (training/prompt_mix.py), greedy, one request at a time, after a warm-up request. Phases are timed by
wrapping the methods (time.perf_counter): `Engine.step`, `ModelRunner.forward`, `MTPDraft.extend` (which includes
`_chain`), `MTPDraft._chain`. Prints ms per step and per output token for each side."""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

from radixserve import LLM, SamplingParams
from training.prompt_mix import prompts


def timed(obj, name: str, times: dict[str, list[float]], key: str, sizes: list[int] | None = None) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - start)
            if sizes is not None:
                sizes.append(sum(len(s.input_ids) for s in args[0]))
    setattr(obj, name, wrapper)


def run(kwargs: dict, conversations: list[list[dict]], max_tokens: int) -> None:
    llm = LLM(max_running_requests=16, **kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    engine, times, sizes = llm.engine, defaultdict(list), []
    timed(engine, "step", times, "step")
    timed(engine.runner, "forward", times, "forward", sizes)
    if engine.runner.mtp is not None:
        timed(engine.runner.mtp, "extend", times, "extend")
        timed(engine.runner.mtp, "_chain", times, "chain")
    start, tokens = time.perf_counter(), 0
    for c in conversations:
        tokens += len(llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids)
    wall = time.perf_counter() - start
    llm.close()
    steps = len(times["step"])
    by_size = defaultdict(list)
    for n, t in zip(sizes, times["forward"]):
        by_size[n].append(t)
    print(f"{kwargs}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s, {steps} steps, "
          f"{tokens / steps:.2f} tokens/step")
    for key, values in times.items():
        print(f"  {key:8s} {1000 * sum(values) / steps:6.2f} ms/step  ({len(values)} calls)")
    print("  forward by step tokens: " + ", ".join(
        f"{n}: {1000 * sum(v) / len(v):.2f} ms x{len(v)}" for n, v in sorted(by_size.items()) if len(v) >= 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=None)
    ap.add_argument("--draft-min-prob", type=float, default=None)
    ap.add_argument("--draft-model-path", default=None)
    args = ap.parse_args()
    conversations = [[{"role": "user", "content": text}] for _, text in prompts(args.prompts, "heldout", seed=1)]
    eagle = {"speculative_algorithm": "EAGLE", "speculative_num_steps": args.num_steps,
             "speculative_draft_min_prob": args.draft_min_prob,
             "speculative_draft_model_path": args.draft_model_path}
    for kwargs in ({"speculative_algorithm": "none"}, {k: v for k, v in eagle.items() if v is not None}):
        run(kwargs, conversations, args.max_tokens)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
