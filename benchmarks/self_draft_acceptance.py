"""How often a self-draft of the default model's first L layers agrees with the full model.

Run:  PYTHONPATH=. python benchmarks/self_draft_acceptance.py --layers 8,20,28 [--max-tokens 96]

For each L: the offline API with `--speculative-algorithm draft --speculative-draft-layers L`
(K=4, greedy), 8 chat questions (explanation, code, list, translation, copy-edit, poem, pros
and cons, summary) at once; prints each request's accept length (tokens per verify step) and
accept rate (accepted / draft tokens) from RequestOutput.spec, the wall time and the load.
"""
from __future__ import annotations

import argparse
import os
import time

QUESTIONS = ["Explain photosynthesis in simple terms.", "Write a Python function that reverses a string.",
             "List five facts about volcanoes.", "Translate to French: 'I like apples.'",
             "Repeat this code exactly, but rename `data` to `result`:\n\ndef load(path):\n"
             "    data = {}\n    return data\n",
             "Write a short poem about the sea.", "What are the pros and cons of electric cars?",
             "Summarize the history of chess."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,20,28")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    from radixserve import LLM, SamplingParams

    for layers in (int(x) for x in args.layers.split(",")):
        llm = LLM(speculative_algorithm="draft", speculative_draft_layers=layers,
                  max_total_tokens=32768, disable_radix_cache=True)
        start = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
        wall = time.perf_counter() - start
        rows = [(o.spec.accept_length, o.spec.accept_rate) if o.spec else (None, None) for o in outs]
        print(f"L={layers}: wall {wall:.1f} s, load {os.getloadavg()[0]:.2f}")
        for q, (length, rate) in zip(QUESTIONS, rows):
            print(f"  accept length {length or 0:.2f}  accept rate {rate or 0:.2f}  {q[:40]!r}")


if __name__ == "__main__":
    main()
