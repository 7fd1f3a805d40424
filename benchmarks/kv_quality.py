"""KV dtype quality on the default model: fp8 / bf16 KV against fp32 KV, by output position and by conversation round.

Run:  python benchmarks/kv_quality.py [--kv-dtypes bfloat16,fp8_e4m3,fp8_e5m2] [--max-tokens 1024]

Compute stays fp32; only the stored KV differs. Reference: fp32 KV.
1. Long outputs: each prompt's greedy continuation with fp32 KV (ignore_eos, --max-tokens) is
   teacher-forced through each KV dtype with prompt_logprobs=1 (in 512-token chunks, so every
   chunk after the first reads the earlier tokens back from the quantised cache). Per output-position
   bucket (1-64, 65-256, 257-1024): greedy agreement (the dtype's top-1 == the reference token)
   and mean |Δ logprob| of the reference token. Free-running greedy decoding with each dtype
   also gives the first position where its output leaves the reference.
2. Multi-turn: a 5-round chat (reference replies of 96 tokens, fp32 KV); round r's reply is
   scored through each dtype with the conversation so far served from the radix cache (the
   earlier rounds' KV stays as the dtype stored it), mean |Δ logprob| per round.
   "fp8_e4m3 per-layer" is the calibrated fp8_e4m3 with one scale per layer (max over KV
   heads) instead of one per (layer, KV head).
3. Capacity: KV tokens that fit in --kv-cache-memory-gb for fp32, bf16, fp8.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from radixserve import LLM, SamplingParams
from radixserve.engine_config import EngineConfig
from radixserve.runner.kv_cache import KVCache
from radixserve.runner.kv_sizing import kv_storage_dtype, num_pages

PROMPTS = [
    "Count from 1 to 500, separated by commas.",
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a CPU cache works, with examples.",
    "Repeat the following text exactly, word for word: The quick brown fox jumps over the lazy dog. "
    "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump. Sphinx of black "
    "quartz, judge my vow. The five boxing wizards jump quickly.",
]
TURNS = ["Tell me about the history of Paris.", "What about its food?", "And its museums?",
         "Which neighbourhood should I stay in?", "Summarise everything you told me."]
BUCKETS = [(1, 64), (65, 256), (257, 1024)]


def scored(llm: LLM, ids: list[int]) -> list:
    """TokenLogprob (top-1 included) of every position of `ids` after the first."""
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    return out.prompt_logprobs


def long_outputs(ref: LLM, runs: dict[str, LLM], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    reference = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    print(f"\n## Long outputs ({len(prompts)} prompts x {max_tokens} tokens, teacher-forced)")
    print("| KV dtype | bucket | greedy agreement | mean abs Δ logprob |\n|---|---|---:|---:|")
    base = {i: scored(ref, p + r) for i, (p, r) in enumerate(zip(prompts, reference))}
    for name, llm in {"float32": ref, **runs}.items():
        rows = {b: [0, 0, 0.0] for b in BUCKETS}
        for i, (p, r) in enumerate(zip(prompts, reference)):
            got = scored(llm, p + r) if llm is not ref else base[i]
            for pos in range(1, len(r) + 1):
                g, w = got[len(p) + pos - 2], base[i][len(p) + pos - 2]
                for lo, hi in BUCKETS:
                    if lo <= pos <= hi:
                        row = rows[(lo, hi)]
                        row[0] += g.top[0][0] == r[pos - 1]
                        row[1] += 1
                        row[2] += abs(g.logprob - w.logprob)
        for (lo, hi), (agree, n, delta) in rows.items():
            if n:
                print(f"| {name} | {lo}-{hi} | {agree / n:.2%} | {delta / n:.4f} |")
    print("\n| KV dtype | first divergence from fp32 KV, free-running greedy (per prompt) |\n|---|---|")
    for name, llm in runs.items():
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        first = [next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
        print(f"| {name} | {', '.join(map(str, first))} (of {max_tokens}) |")


def multi_turn(ref: LLM, runs: dict[str, LLM], reply_tokens: int) -> None:
    params = SamplingParams(max_tokens=reply_tokens, temperature=0)
    messages: list[dict] = []
    spans = []                                  # (start, end) of each round's reply in the ids
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        out = ref.chat(messages, params, use_tqdm=False)[0].outputs[0]
        messages.append({"role": "assistant", "content": out.text})
        ids = ref.tokenizer.apply_chat_template(messages[:-1])
        spans.append((len(ids), len(ids) + len(out.token_ids), out.token_ids))
    print(f"\n## Multi-turn (5 rounds, {reply_tokens}-token replies, earlier rounds from the radix cache)")
    print("| KV dtype | " + " | ".join(f"round {i + 1}" for i in range(len(TURNS))) + " |")
    print("|---|" + "---:|" * len(TURNS))
    for name, llm in {"float32": ref, **runs}.items():
        cells = []
        for start, end, reply in spans:
            ids = ref.tokenizer.apply_chat_template(messages[:2 * len(cells) + 1]) + reply
            got = scored(llm, ids)
            want = scored(ref, ids)
            delta = [abs(g.logprob - w.logprob) for g, w in zip(got[start - 1:end - 1], want[start - 1:end - 1])]
            cells.append(f"{sum(delta) / len(delta):.4f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--reply-tokens", type=int, default=96)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    args = ap.parse_args()
    common = dict(max_total_tokens=16384, chunked_prefill_size=512)
    ref = LLM(**common)
    runs = {d: LLM(kv_cache_dtype=d, **common) for d in args.kv_dtypes.split(",")}
    if "fp8_e4m3" in runs:  # the same calibration with one scale per layer (max over KV heads)
        scales = runs["fp8_e4m3"].engine.runner.kv_scales
        path = os.path.join(tempfile.mkdtemp(), "per_layer.json")
        with open(path, "w") as f:
            json.dump({"k_scale": scales.k.amax(1).tolist(), "v_scale": scales.v.amax(1).tolist()}, f)
        runs["fp8_e4m3 per-layer"] = LLM(kv_cache_dtype="fp8_e4m3", quantization_param_path=path, **common)
    print(f"load {os.getloadavg()[0]:.2f}; fp8 scales: " +
          "; ".join(f"{d} {llm.engine.runner.info().get('kv_scales', {}).get('source')}" for d, llm in runs.items()))
    long_outputs(ref, runs, args.max_tokens)
    multi_turn(ref, runs, args.reply_tokens)
    print(f"\n## Capacity at --kv-cache-memory-gb {args.kv_cache_memory_gb}")
    mc = ref.engine.runner.model_config
    for d in ("float32", "bfloat16", "fp8_e4m3"):
        cfg = EngineConfig(kv_cache_dtype=d, kv_cache_memory_gb=args.kv_cache_memory_gb)
        per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_storage_dtype(cfg))
        pages = num_pages(cfg, mc)
        print(f"| {d} | {per_token} B/token | {pages * cfg.page_size} tokens |")


if __name__ == "__main__":
    main()
