"""Multi-turn drift of FP8 KV against model-dtype KV, per turn: all FP8 vs FP8 with model-dtype history (case C39).

Run:  python benchmarks/kv_history_drift.py [--conversations 20] [--reply-tokens 64] [--model PATH]

Three engines over one model (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF), compute fp32:
  model  --kv-cache-dtype auto (fp32 KV; the reference)
  fp8    --kv-cache-dtype fp8_e4m3 (every page FP8, the radix tree keeps earlier turns' FP8 KV)
  mixed  --kv-cache-dtype fp8_e4m3 --kv-history-dtype auto (history fp32, the turn being generated FP8)
Each conversation is a system prompt and 4 user turns; every engine gets the same prompts, built from the
reference's own replies (token ids, so earlier turns hit each engine's radix cache). Replies are greedy, up to
--reply-tokens, stopping at EOS. Per turn and engine: how many replies equal the reference's, and for the others
the first position where the reply leaves the reference's (median, min); |Δ logprob| of the reference's token
under each KV against the reference's own, at every position up to and including that divergence (their contexts
are identical, so the difference is the KV's alone; from the top 5 logprobs), at the first reply token and mean /
max over all of them; and the mean radix hit in tokens. Last, generated tokens per second of 8 requests on each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from radixserve import LLM, SamplingParams

SYSTEMS = ["You are a helpful assistant.", "You are a concise expert. Answer briefly and precisely.",
           "You are a friendly teacher who explains things simply."]
TOPICS = ["Paris", "volcanoes", "the Roman Empire", "photosynthesis", "black holes", "the piano", "honey bees",
          "the Internet", "chess", "the Moon landing", "coffee", "the Amazon rainforest", "electric cars",
          "the printing press", "octopuses", "the Olympic Games", "glaciers", "jazz", "vaccines", "the Sahara"]
TURNS = ["Tell me about {}.", "What is the most surprising thing about it?",
         "Give me three facts a child would enjoy.", "Summarise our conversation in two sentences."]
SETTINGS = {"model": {}, "fp8": {"kv_cache_dtype": "fp8_e4m3"},
            "mixed": {"kv_cache_dtype": "fp8_e4m3", "kv_history_dtype": "auto"}}


def turn_blocks(llm: LLM, system: str, text: str) -> tuple[list[int], list[int]]:
    """(ids closing an assistant turn, ids of the next user turn through the assistant header), from the template."""
    ids = llm.tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": text}])
    second = ids.index(ids[0], 1)                     # the user block's <|im_start|>
    return ids[second - 2:second], ids[second:]


def reply_of(out, eos: frozenset[int]) -> tuple[list[int], list[dict[int, float]]]:
    """The reply's ids (EOS dropped) and per position {token id: logprob} of the chosen token and the top k."""
    ids = list(out.outputs[0].token_ids)
    lps = [{lp.token_id: lp.logprob, **dict(lp.top)} for lp in out.outputs[0].logprobs]
    while ids and ids[-1] in eos:
        ids, lps = ids[:-1], lps[:-1]
    return ids, lps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--reply-tokens", type=int, default=64)
    args = ap.parse_args()
    common = dict(max_total_tokens=16384, chunked_prefill_size=1024, page_size=16)
    engines = {name: LLM(args.model, **common, **kw) for name, kw in SETTINGS.items()}
    ref = engines["model"]
    eos = frozenset(ref.engine.eos_token_ids)
    convs = [(SYSTEMS[i % len(SYSTEMS)], TOPICS[i % len(TOPICS)]) for i in range(args.conversations)]
    prompts = [ref.tokenizer.apply_chat_template([{"role": "system", "content": s},
                                                   {"role": "user", "content": TURNS[0].format(t)}]) for s, t in convs]
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, logprobs=5)
    print(f"load {os.getloadavg()[0]:.2f}; {args.conversations} conversations x {len(TURNS)} turns, "
          f"replies <= {args.reply_tokens} tokens; mixed pages: {engines['mixed'].engine.runner.info()['kv_pages']}")
    print("| turn | KV | mean prompt tokens | mean radix hit | replies equal to the reference's | first divergence "
          "of the others: median (min) | abs Δ logprob, first token: mean | up to the divergence: mean / max |")
    print("|---|---|---:|---:|---:|---|---:|---|")
    start = time.perf_counter()
    for turn in range(len(TURNS)):
        raw = {name: llm.generate(prompts, params, use_tqdm=False) for name, llm in engines.items()}
        outs = {name: [reply_of(o, eos) for o in results] for name, results in raw.items()}
        for name in SETTINGS:
            firsts, first_d, deltas, equal = [], [], [], 0
            for (ids, lps), (ref_ids, ref_lps) in zip(outs[name], outs["model"]):
                div = next((j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
                equal += ids == ref_ids
                if ids != ref_ids:
                    firsts.append(div)
                # positions 0..div share their context: the reference token's logprob under each KV
                d = [abs(lps[j][ref_ids[j]] - ref_lps[j][ref_ids[j]])
                     for j in range(min(div + 1, len(ids), len(ref_ids))) if ref_ids[j] in lps[j]]
                first_d += d[:1]
                deltas += d
            hit = statistics.mean(o.num_cached_tokens for o in raw[name])
            print(f"| {turn + 1} | {name} | {statistics.mean(len(p) for p in prompts):.0f} | {hit:.0f} | "
                  f"{equal}/{len(prompts)} | {f'{statistics.median(firsts):.0f} ({min(firsts)})' if firsts else '-'} | "
                  f"{statistics.mean(first_d):.4f} | "
                  f"{statistics.mean(deltas):.4f} / {max(deltas):.4f} |")
        if turn + 1 < len(TURNS):
            blocks = [turn_blocks(ref, s, TURNS[turn + 1].format(t)) for s, t in convs]
            prompts = [p + ids + close + user for p, (ids, _), (close, user) in zip(prompts, outs["model"], blocks)]
    print(f"\nwall {time.perf_counter() - start:.0f} s")
    decode_speed(engines, prompts[:8], args.reply_tokens)


def decode_speed(engines: dict[str, LLM], prompts: list[list[int]], num_tokens: int) -> None:
    """Batch of len(prompts) requests, num_tokens each (ignore_eos), on each engine after a flush, two rounds
    interleaved: generated tokens per second (prefill included; the prompts are the last turn's)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    best = {name: 0.0 for name in engines}
    for _ in range(2):
        for name, llm in engines.items():
            llm.engine.flush_cache()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best[name] = max(best[name], len(prompts) * num_tokens / (time.perf_counter() - start))
    print(f"\n{len(prompts)} requests x {num_tokens} tokens, best of 2: " +
          ", ".join(f"{name} {rate:.0f} tokens/s" for name, rate in best.items()) + f"; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
