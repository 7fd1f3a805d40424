"""Acceptance and confidence as anomaly detectors: detection rate, tokens to detection and false positives of the text, acceptance, confidence and combined detectors.

Run:  PYTHONPATH=. python benchmarks/spec_anomaly.py [--algorithm eagle|ngram|draft|none] [--draft-layers L]
          [--num-normal 2000] [--num-faulted 300] [--num-ready 100] [--max-tokens 160] [--concurrency 32]
          [--draft-min-prob P] [--break-even-tokens B] [--out DIR]

In-process on the embedded SmolLM2-135M-Instruct with speculation on (its trained EAGLE head, S=3; n-gram
drafts, or a self-draft of the first L of its 30 layers; K=4) and the radix cache off (a corrupted page then
belongs to one request only):

1. normal: `--num-normal` chat requests, a quarter each of chat (explanations, lists, poems,
   tables, JSON, stories), code (write a function), copy-heavy editing (repeat a code file or a
   paragraph with one name changed) and multilingual (translate into eight languages); half
   greedy, half temperature 0.7 with a seed. Every detection here is a false positive.
2. faulted: `--num-faulted` more requests from the same mix, run twice: clean, then with the
   engine's kv_corrupt fault armed for all of them (a third each of noise, swap and stale: another
   running request's KV, or a free page's, what a finished request left; fraction 0.5, after 16
   generated tokens). A request counts as corrupted when the fault hit it and its output then
   differs from its clean run (same seed); the detection rate is over those.
3. ready: `--num-ready` requests behind long shared preambles on an engine with the host KV tier,
   clean and then with the forward reading host-tier loads before they land
   (benchmarks/spec_anomaly_ready.py; mode "ready", hit at token 0).

Every request's stream (text deltas, token ids, cumulative acceptance counts, each token's
confidence) is recorded and the detectors are replayed over it, exactly as the server feeds
them, for each detector set: text (repetition, garbled, rare_chars), acceptance
(AcceptanceDetector), confidence (ConfidenceDetector) and combined (all of them). Detection
is also reported per corruption mode. With `--kv-checksum` the engine also runs its KV checksums
(--enable-kv-checksum, engine/kv_checksum.py), which end a request whose KV was overwritten;
the summary then has a `kv_checksum` row over every request the fault hit (whether or not its
output changed) and the normal ones, and a `combined_and_kv_checksum` row (either ends it). In
such a run the output-side rows' detection is over outputs the checksum may have cut short; their
false positives are unaffected. Writes traces.jsonl and summary.json under --out and
prints the table for docs/anomaly_guard.md. `--summarize TRACES` replays a recorded run with
the current detector settings (`--confidence-*` as the server's flags).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import sys
import time

from radixserve.chaos.kv_corrupt import MODES as KV_MODES
from radixserve.outputs import KV_CHECKSUM_ERROR, SpecCounts
from radixserve.sampling_params import SamplingParams
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.anomaly import AnomalyGuard, GuardConfig
from radixserve.server.tracker import ChoiceUpdate
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged

TOPICS = ["photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes",
          "the stock market", "honey bees", "the Roman Empire", "climate change", "coffee",
          "the Moon landing", "jazz music", "recycling", "the internet", "dinosaurs", "vaccines",
          "chess", "electric cars", "Shakespeare", "the water cycle", "bread baking", "penguins",
          "solar panels", "ancient Egypt", "sleep", "trains", "glaciers", "origami", "tea", "kites"]
CHAT = ["Explain {t} in simple terms.", "List five facts about {t}.", "Write a short poem about {t}.",
        "Write a markdown table with three facts about {t}.", "Give me a JSON object describing {t}.",
        "What are the pros and cons of {t}? Answer as a bulleted list.",
        "Continue the story: 'On the day I first learned about {t}, ...'",
        "Summarize the history of {t} in one paragraph."]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "merges two sorted lists",
              "counts the words in a text", "computes a factorial", "flattens a nested list",
              "parses a CSV line", "finds the maximum of a list", "removes duplicates from a list",
              "converts Celsius to Fahrenheit", "computes Fibonacci numbers", "validates an email"]
LANGS = ["French", "German", "Spanish", "Italian", "Chinese", "Japanese", "Russian", "Portuguese"]
SENTENCES = ["I would like to learn more about {t}.", "Where can I read about {t}?",
             "My friend told me a story about {t}.", "Tomorrow we will talk about {t}.",
             "Is {t} important for children?"]
SNIPPETS = ['''def load(path):
    data = {}
    with open(path) as handle:
        for line in handle:
            key, value = line.strip().split("=", 1)
            data[key] = value
    return data
''', '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

    def reset(self):
        self.count = 0
''', '''def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax)
''']
RENAMES = [("data", "result"), ("count", "total"), ("items", "products"), ("value", "entry"),
           ("handle", "stream"), ("step", "amount"), ("subtotal", "base")]
PARAGRAPH = ("{t} is a topic that many people find interesting. Scientists study {t} to learn how "
             "it works, and teachers explain {t} to students every year. Books about {t} are "
             "easy to find in any library.")


def conversation(rng: random.Random, category: str) -> list[dict]:
    """One user message of `category` (chat, code, copy, multilingual)."""
    t = rng.choice(TOPICS)
    if category == "chat":
        text = rng.choice(CHAT).format(t=t)
    elif category == "code":
        text = f"Write a Python function that {rng.choice(CODE_TASKS)}, with a docstring."
    elif category == "copy":
        if rng.random() < 0.6:
            old, new = rng.choice(RENAMES)
            text = f"Repeat this code exactly, but rename `{old}` to `{new}`:\n\n{rng.choice(SNIPPETS)}"
        else:
            other = rng.choice(TOPICS)
            text = (f"Rewrite this paragraph, replacing '{t}' with '{other}':\n\n"
                    + PARAGRAPH.format(t=t))
    else:
        text = f"Translate to {rng.choice(LANGS)}: '{rng.choice(SENTENCES).format(t=t)}'"
    return [{"role": "user", "content": text}]


MODES = (*KV_MODES, "ready")   # kv_corrupt's modes, then read-before-ready (benchmarks/spec_anomaly_ready.py)


def workload(rng: random.Random, num: int, max_tokens: int) -> list[tuple[str, list[dict], SamplingParams]]:
    categories = ("chat", "code", "copy", "multilingual")
    items = []
    for i in range(num):
        category = categories[i % 4]
        greedy = (i // 4) % 2 == 0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 0.7,
                                seed=None if greedy else rng.getrandbits(31), guard_confidence=True)
        items.append((category, conversation(rng, category), params))
    return items


def with_faults(llm):
    """`llm` with its engine rebuilt over the same runner with chaos/'s EngineFaults attached (kv_corrupt);
    returns the faults."""
    from radixserve.chaos.engine_faults import EngineFaults
    from radixserve.compose import engine_hooks
    from radixserve.engine.engine import Engine

    faults = EngineFaults()
    llm.engine = Engine(llm.config, llm.engine.runner, llm.tokenizer.eos_token_ids,
                        [*engine_hooks(llm.config), faults])
    return faults


def run(llm, items, concurrency: int, corrupt: str | None = None) -> list[dict]:
    """Generate every item, `concurrency` in flight; return per item its trace: deltas
    [text, token ids, [verify, draft, accepted] or None, confidences], tokens, and the
    kv_corrupt hit."""
    from radixserve.server.tracker import RequestTracker

    engine, tok = llm.engine, llm.tokenizer
    if corrupt is not None:
        llm.faults.arm_kv_corrupt(corrupt, fraction=0.5, after_tokens=16, count=len(items), seed=7)
    traces: list[dict] = [{} for _ in items]
    trackers: dict[str, tuple[int, RequestTracker]] = {}
    generated: dict[int, int] = {}
    pending = list(range(len(items)))[::-1]
    while pending or trackers:
        while pending and len(trackers) < concurrency:
            i = pending.pop()
            category, conv, params = items[i]
            ids = tok.apply_chat_template(conv)
            tracker = RequestTracker(f"r{i}", ids, params, tok)
            (child, child_params), = tracker.child_requests()
            engine.add_request(child, ids, child_params)
            trackers[child] = (i, tracker)
            traces[i] = {"category": category, "greedy": params.temperature == 0,
                         "temperature": params.temperature, "deltas": []}
        for out in engine.step():
            i, tracker = trackers[out.request_id]
            generated[i] = generated.get(i, 0) + len(out.new_token_ids)
            if out.error_code == KV_CHECKSUM_ERROR:   # --kv-checksum ended it
                traces[i]["checksum_at"] = generated[i]
            u = tracker.process(out)
            if u.abort_child is not None:
                engine.abort(u.abort_child)
            if not u.is_empty:
                spec = dataclasses.astuple(u.spec) if u.spec is not None else None
                traces[i]["deltas"].append([u.text, u.token_ids, spec, u.confidences])
            if tracker.finished:
                del trackers[out.request_id]
                traces[i]["tokens"] = tracker.result().outputs[0].token_ids
    hits = dict(llm.faults.kv_corrupt_hits)
    llm.faults.disarm_kv_corrupt()
    for i, t in enumerate(traces):
        t["hit_at"] = hits.get(f"r{i}-0")
    return traces


SETS = ("text", "acceptance", "confidence", "combined")


def detect(trace: dict, detectors: str, acc: AcceptanceConfig, conf: ConfidenceConfig) -> tuple[str, int] | None:
    """Replay the trace through one detector set (SETS); (kind, tokens generated at detection)
    or None. Traces recorded before confidences were (3-item deltas) have none."""
    extra = []
    if detectors in ("acceptance", "combined"):
        extra.append(AcceptanceDetector(acc, trace["greedy"]))
    if detectors in ("confidence", "combined") and judged(conf, trace.get("temperature", 0.0), False):
        extra.append(ConfidenceDetector(conf))
    guard = AnomalyGuard(GuardConfig(), extra_detectors=extra, loops_expected=trace["greedy"])
    if detectors in ("acceptance", "confidence"):
        guard.detectors = extra
    num = 0
    for text, ids, spec, *conf_values in trace["deltas"]:
        num += len(ids)
        found = guard.feed(ChoiceUpdate(0, text, ids, spec=SpecCounts(*spec) if spec else None,
                                        confidences=conf_values[0] if conf_values else []))
        if found is not None:
            return found.kind, num
    return None


def summarize(normal: list[dict], clean: list[dict], faulted: list[dict],
              acc: AcceptanceConfig, conf: ConfidenceConfig) -> dict:
    corrupted = [f for c, f in zip(clean, faulted)
                 if f["hit_at"] is not None and f["tokens"] != c["tokens"]]
    out = {"num_normal": len(normal), "num_faulted": len(faulted), "num_corrupted": len(corrupted),
           "num_corrupted_by_mode": {m: sum(t.get("mode") == m for t in corrupted) for m in MODES},
           "acceptance_config": dataclasses.asdict(acc), "confidence_config": dataclasses.asdict(conf)}
    for detectors in SETS:
        fp = [detect(t, detectors, acc, conf) for t in normal]
        hits = [(detect(t, detectors, acc, conf), t["hit_at"], t.get("mode")) for t in corrupted]
        # tokens from the hit to the detection (a detection before the hit is not one)
        caught = [(found[1] - hit_at, mode) for found, hit_at, mode in hits
                  if found is not None and found[1] >= hit_at]
        delays = sorted(d for d, _ in caught)
        by_cat: dict[str, list[int]] = {}
        for t, found in zip(normal, fp):
            by_cat.setdefault(t["category"], []).append(found is not None)
        out[detectors] = {
            "false_positives": sum(f is not None for f in fp),
            "false_positive_rate": sum(f is not None for f in fp) / max(len(normal), 1),
            "false_positives_by_category": {k: sum(v) for k, v in by_cat.items()},
            "detected": len(caught), "detection_rate": len(caught) / max(len(corrupted), 1),
            "detected_by_mode": {m: sum(mode == m for _, mode in caught) for m in MODES},
            "tokens_to_detection_median": delays[len(delays) // 2] if delays else None,
        }
    if any(t.get("checksum") for t in normal):   # a --kv-checksum run
        hit = [t for t in faulted if t["hit_at"] is not None]
        delays = sorted(t["checksum_at"] - t["hit_at"] for t in hit if t.get("checksum_at") is not None)
        out["kv_checksum"] = {
            "false_positives": sum(t.get("checksum_at") is not None for t in normal),
            "num_hit": len(hit), "detected": len(delays),
            "detected_by_mode": {m: sum(t.get("mode") == m and t.get("checksum_at") is not None for t in hit)
                                 for m in MODES},
            "tokens_to_detection_median": delays[len(delays) // 2] if delays else None}
        # Every detector at once: the combined output-side set or the checksum. Over the hit
        # requests (the checksum ends one before its output can be compared with the clean run).
        def caught(t: dict) -> bool:
            found = detect(t, "combined", acc, conf)
            by_output = found is not None and (t["hit_at"] is None or found[1] >= t["hit_at"])
            return by_output or t.get("checksum_at") is not None
        out["combined_and_kv_checksum"] = {
            "false_positives": sum(caught(t) for t in normal),
            "false_positive_rate": sum(caught(t) for t in normal) / max(len(normal), 1),
            "num_hit": len(hit), "detected": sum(caught(t) for t in hit),
            "detection_rate": sum(caught(t) for t in hit) / max(len(hit), 1)}
    return out


def median_accept_length(traces: list[dict]) -> float | None:
    """Median over requests that verified drafts of their final accept length."""
    finals = [SpecCounts(*t["deltas"][-1][2]).accept_length for t in traces
              if t["deltas"] and t["deltas"][-1][2]]
    return sorted(finals)[len(finals) // 2] if finals else None


def load_traces(path: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(normal, clean, faulted) traces from a traces.jsonl this script wrote."""
    phases: dict[str, list[dict]] = {"normal": [], "clean": [], "faulted": []}
    with open(path) as f:
        for line in f:
            t = json.loads(line)
            phases[t.pop("phase")].append(t)
    return phases["normal"], phases["clean"], phases["faulted"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-normal", type=int, default=2000)
    ap.add_argument("--num-faulted", type=int, default=300, help="a third each of kv_corrupt's noise, swap, stale")
    ap.add_argument("--num-ready", type=int, default=100, help="read-before-ready requests (0: no such phase)")
    ap.add_argument("--ready-concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default="/tmp/spec_anomaly")
    ap.add_argument("--algorithm", choices=("eagle", "ngram", "draft", "none"), default="eagle",
                    help="eagle: the default model's trained draft head (S = 3); none: no "
                         "speculation (the acceptance detector then sees nothing)")
    ap.add_argument("--draft-layers", type=int, default=8, help="draft: self-draft depth")
    ap.add_argument("--kv-checksum", action="store_true", help="run the engine with --enable-kv-checksum")
    ap.add_argument("--draft-min-prob", type=float, default=None,
                    help="--speculative-draft-min-prob (unset: the engine's default; 0 drafts every step)")
    ap.add_argument("--break-even-tokens", type=float, default=None,
                    help="--speculative-break-even-tokens (unset: the engine's default; 0 never holds drafts back)")
    ap.add_argument("--summarize", metavar="TRACES", help="only recompute the summary of a "
                    "traces.jsonl written before (e.g. with other detector settings)")
    ap.add_argument("--confidence-window", type=int, default=ConfidenceConfig.window)
    ap.add_argument("--confidence-min-mean-logprob", type=float, default=ConfidenceConfig.min_mean_logprob)
    ap.add_argument("--confidence-min-drop", type=float, default=ConfidenceConfig.min_drop)
    ap.add_argument("--confidence-max-temperature", type=float, default=ConfidenceConfig.max_temperature)
    args = ap.parse_args()
    conf = ConfidenceConfig(window=args.confidence_window,
                            min_mean_logprob=args.confidence_min_mean_logprob, min_drop=args.confidence_min_drop,
                            max_temperature=args.confidence_max_temperature)
    from radixserve import LLM

    if args.summarize:
        print(json.dumps(summarize(*load_traces(args.summarize), AcceptanceConfig(), conf), indent=2))
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = {"speculative_draft_layers": args.draft_layers} if args.algorithm == "draft" else {}
    spec = ({"speculative_algorithm": "none"} if args.algorithm == "none"
            else {"speculative_algorithm": "EAGLE"} if args.algorithm == "eagle"
            else {"speculative_algorithm": args.algorithm, "speculative_num_draft_tokens": 4})
    gates = {k: v for k, v in (("speculative_draft_min_prob", args.draft_min_prob),
                               ("speculative_break_even_tokens", args.break_even_tokens)) if v is not None}
    llm = LLM(**spec, **gates, enable_kv_checksum=args.kv_checksum,
              disable_radix_cache=True, max_total_tokens=65536, **draft)
    llm.faults = with_faults(llm)
    start = time.monotonic()
    normal = run(llm, workload(random.Random(1), args.num_normal, args.max_tokens), args.concurrency)
    for t in normal:
        t["checksum"] = args.kv_checksum
    (out / "normal.json").write_text(json.dumps(normal))   # kept if a later phase fails
    print(f"normal phase done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    faulted_items = workload(random.Random(2), args.num_faulted, args.max_tokens)
    third = -(-len(faulted_items) // len(KV_MODES))
    clean, faulted = [], []
    for k, mode in enumerate(KV_MODES):
        part = faulted_items[k * third:(k + 1) * third]
        if not part:
            continue
        clean += run(llm, part, args.concurrency)
        faulted += [dict(t, mode=mode) for t in run(llm, part, args.concurrency, corrupt=mode)]
        print(f"{mode} phase done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    if args.num_ready:
        llm.close()
        from benchmarks import spec_anomaly_ready as ready
        work = ready.items(workload(random.Random(4), args.num_ready, args.max_tokens), TOPICS)
        c, f = ready.ready_traces({**spec, **gates, **draft, "enable_kv_checksum": args.kv_checksum}, run, with_faults,
                                  work, args.ready_concurrency)
        clean, faulted = clean + c, faulted + f
        print(f"ready phase done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    with open(out / "traces.jsonl", "w") as f:
        for phase, traces in (("normal", normal), ("clean", clean), ("faulted", faulted)):
            for t in traces:
                f.write(json.dumps({"phase": phase, **t}) + "\n")
    summary = summarize(normal, clean, faulted, AcceptanceConfig(), conf)
    summary["algorithm"] = args.algorithm if args.algorithm != "draft" else f"self-draft L={args.draft_layers}"
    summary["normal_accept_length_median"] = median_accept_length(normal)
    summary["wall_s"] = round(time.monotonic() - start, 1)
    summary["load_avg_1m_at_end"] = os.getloadavg()[0]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
