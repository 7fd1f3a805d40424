"""Speculative decoding on vs off on the default model, same process, output tok/s and the ratio.

Run:  python benchmarks/speculative.py [--algorithm ngram|eagle] [--reps 4] [--draft-tokens 8] [--torch-compile-max-bs N]
                                       [--break-even-tokens R] [--only chat]
                                       [--num-steps S] [--draft-min-prob P] [--draft-model-path HEAD]

`--algorithm eagle` is the default model's trained draft head (weights/default_draft.py); ngram is prompt lookup. The
"off" side runs --speculative-algorithm none.

Both sides are engines in this process (offline API, greedy, at most 16 requests running), built
once; each repetition runs every workload on both, in alternating order (AB BA ...), from an
empty prefix cache and an empty shared n-gram table (the repeated prompts would otherwise be
drafted from the last repetition's answers). The acceptance prior a server learns from its
traffic is kept, as on a warm server. Workloads:
- copy-edit c1: the model is asked to repeat a code file with one identifier renamed: most
  output tokens copy the context, where prompt lookup pays.
- chat c16: 64 short unrelated chat questions, 16 running at a time (SGLang's
  `--max-concurrency 16`): little to copy, speculation must back off and cost little.
- chat burst16: the first 16 of them at once, one wave: the wall time is the longest answer's.
- heldout c1 / heldout c16: 8 (c1, one request at a time) and 64 (16 running) chat, code, copy-editing,
  translation and summary prompts from training/prompt_mix.py's held-out split (subjects the draft head
  never saw in training), 128 tokens each.
Prints per side the median tok/s over the repetitions, every run, the spec/off ratio, the
acceptance counters summed over the repetitions, and the load average. Greedy outputs of the
two sides are compared (they must be equal).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

CODE = '''def parse_config(path):
    """Read a key=value config file into a dict."""
    config = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Who wrote Hamlet?", "Give me a synonym for happy.", "What is the boiling point of water?",
             "How many legs does a spider have?", "What is the largest planet?", "Say hello in Spanish.",
             "What color is the sky on a clear day?", "Name a famous painter.", "What is H2O?",
             "How many days are in a week?", "What is the opposite of cold?", "Name a fruit that is yellow.",
             "What do bees make?"]

TOPICS = ["photosynthesis", "black holes", "the Roman Empire", "volcanoes", "the moon", "rainbows",
          "electricity", "bicycles", "coffee", "the ocean", "gravity", "dinosaurs", "the internet",
          "music", "chess", "glaciers"]
TEMPLATES = ["Explain {t} in one sentence.", "Give two facts about {t}.", "Why is {t} interesting?"]
CONCURRENCY = 16


def workloads() -> dict[str, tuple[list[list[dict]], int]]:
    """name -> (conversations, max_tokens)."""
    edit = [{"role": "user", "content": "Repeat this code exactly, but rename `config` to `settings`:\n\n" + CODE}]
    chat = [[{"role": "user", "content": q}]
            for q in QUESTIONS + [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]]
    from training.prompt_mix import prompts
    heldout = [[{"role": "user", "content": text}] for _, text in prompts(64, "heldout", seed=1)]
    return {"copy-edit c1": ([edit], 300), "chat c16": (chat, 64), "chat burst16": (chat[:CONCURRENCY], 64),
            "heldout c1": (heldout[:8], 128), "heldout c16": (heldout, 128)}


def build(spec: bool, args: argparse.Namespace):
    from radixserve import LLM, SamplingParams

    gate = {"speculative_break_even_tokens": args.break_even_tokens} if args.break_even_tokens is not None else {}
    if not spec:
        kwargs = {"speculative_algorithm": "none"}
    elif args.algorithm == "ngram":
        kwargs = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens, **gate}
    else:
        eagle = {"speculative_num_steps": args.num_steps, "speculative_draft_min_prob": args.draft_min_prob,
                 "speculative_draft_model_path": args.draft_model_path}   # unset: the default model's trained head
        kwargs = {"speculative_algorithm": "EAGLE", **gate, **{k: v for k, v in eagle.items() if v is not None}}
    if spec and args.torch_compile_max_bs is not None:
        kwargs["torch_compile_max_bs"] = args.torch_compile_max_bs
    llm = LLM(max_total_tokens=32768, max_running_requests=CONCURRENCY, **kwargs)
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4, temperature=0),
             use_tqdm=False)   # warm-up
    return llm


def measure(llm, name: str, conversations: list[list[dict]], max_tokens: int) -> dict:
    """One run from an empty prefix cache and shared n-gram table (`flush_cache`): tok/s, the outputs and the
    speculation counters' increase."""
    from radixserve import SamplingParams

    engine = llm.engine
    assert engine.flush_cache()
    before = {k: v for k, v in engine.counters.items() if k.startswith("spec_") and isinstance(v, int)}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    if name.endswith(" c1"):    # a single stream: one request at a time
        results = [llm.chat(c, params, use_tqdm=False)[0] for c in conversations]
    else:
        results = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [r.outputs[0].token_ids for r in results]
    return {"tok_s": sum(map(len, tokens)) / elapsed, "tokens": tokens,
            **{k: engine.counters[k] - v for k, v in before.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="eagle", choices=("eagle", "ngram"))
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--break-even-tokens", type=float, default=None,
                    help="--speculative-break-even-tokens (default: the engine's)")
    ap.add_argument("--only", default="", help="run only the workloads whose name contains this")
    ap.add_argument("--num-steps", type=int, default=None, help="eagle: --speculative-num-steps")
    ap.add_argument("--draft-min-prob", type=float, default=None, help="eagle: --speculative-draft-min-prob")
    ap.add_argument("--draft-model-path", default=None, help="eagle: a head file other than the packaged one")
    ap.add_argument("--torch-compile-max-bs", type=int, default=None,
                    help="the spec side's --torch-compile-max-bs (unset: the default; the off side keeps it)")
    args = ap.parse_args()
    llms = {False: build(False, args), True: build(True, args)}
    chosen = {name: w for name, w in workloads().items() if args.only in name}
    runs: dict[str, dict[bool, list[dict]]] = {name: {False: [], True: []} for name in chosen}
    for rep in range(args.reps):
        for spec in ((False, True) if rep % 2 == 0 else (True, False)):
            for name, (conversations, max_tokens) in chosen.items():
                runs[name][spec].append(measure(llms[spec], name, conversations, max_tokens))
    print(f"load {os.getloadavg()[0]:.2f}; {args.algorithm}; draft tokens {args.draft_tokens}; break-even tokens "
          f"{args.break_even_tokens or 'default'}; {args.reps} repetitions; num steps {args.num_steps}; draft min "
          f"prob {args.draft_min_prob}; head {args.draft_model_path or 'packaged'}; spec side's compile max bs "
          f"{args.torch_compile_max_bs or 'default'}")
    for name, sides in runs.items():
        off, on = ([r["tok_s"] for r in sides[s]] for s in (False, True))
        same = all(r["tokens"] == sides[False][0]["tokens"] for r in sides[True] + sides[False])
        steps, drafted, accepted = (sum(r[k] for r in sides[True]) for k in (
            "spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
        print(f"{name:14s} off {statistics.median(off):6.1f} tok/s  spec {statistics.median(on):6.1f} tok/s  "
              f"ratio {statistics.median(on) / statistics.median(off):.2f}  greedy outputs equal: {same}  "
              f"(runs off {' '.join(f'{x:.1f}' for x in off)}, spec {' '.join(f'{x:.1f}' for x in on)})  "
              f"verify steps {steps}, accepted {accepted}/{drafted} drafted "
              f"({accepted / drafted if drafted else 0:.2f}; accept length "
              f"{(accepted + steps) / steps if steps else 0:.2f})")


if __name__ == "__main__":
    main()
