"""Output-anomaly guard: false positives on ordinary generations of the default model, detection rate on injected corruption.

Run:  python benchmarks/anomaly_guard.py [--num-ordinary 520] [--num-corrupt 60] [--out DIR]
      (or --url http://HOST:PORT for a worker already started with --enable-fault-injection
      --anomaly-guard-action abort)

Starts `radixserve serve` on the embedded SmolLM2-135M-Instruct with --enable-fault-injection,
then sends chat requests built from mixed prompts (explanations, lists, code, tables,
translations to French / German / Chinese / Japanese, emoji, arithmetic, stories), half at
temperature 0.7 and half greedy, max_tokens drawn from 64..128, `--concurrency` at a time:

1. ordinary: every HTTP 500 "output_anomaly" is a false positive (the worker's
   radixserve:num_anomalies_total{kind} must agree);
2. per corrupt mode (garble, repeat, noise; POST /admin/fault {"kind": "corrupt", "mode"}):
   the share of requests stopped with the kind that mode should trigger, and of the greedy
   ones (repetition is not judged under greedy decoding: anomaly.AnomalyGuard);
3. the guard's cost per character, re-running it on the ordinary texts in 4-character deltas.

Writes ordinary.jsonl (every text and verdict) and summary.json under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import socket
import subprocess
import sys
import time

import httpx

from radixserve.bench.launch import wait_healthy
from radixserve.server.anomaly import AnomalyGuard, GuardConfig
from radixserve.server.tracker import ChoiceUpdate

KIND_OF_MODE = {"garble": "garbled", "repeat": "repetition", "noise": "rare_chars"}
TOPICS = ["photosynthesis", "black holes", "the French Revolution", "machine learning",
          "volcanoes", "the stock market", "honey bees", "the Roman Empire", "climate change",
          "quantum computing", "the human heart", "coffee", "the Moon landing", "jazz music",
          "recycling", "the internet", "dinosaurs", "vaccines", "chess", "the Amazon rainforest",
          "electric cars", "Shakespeare", "the water cycle", "bread baking", "earthquakes",
          "the Olympic Games", "penguins", "solar panels", "ancient Egypt", "sleep"]
TEMPLATES = ["Explain {t} in simple terms.", "List five facts about {t}.",
             "Write a short poem about {t}.", "Write a markdown table with three facts about {t}.",
             "Translate to French: 'I would like to learn more about {t}.'",
             "Translate to Chinese: 'Tell me about {t}.'",
             "Translate to German and Japanese: 'Where can I read about {t}?'",
             "Describe {t} using only emoji.", "Write a Python function related to {t}.",
             "What are the pros and cons of {t}? Answer as a bulleted list.",
             "Continue the story: 'On the day I first learned about {t}, ...'",
             "Give me a JSON object describing {t}.", "What is {a} times {b}? Show your steps.",
             "Write a haiku and a limerick about {t}.", "Summarize the history of {t} in one paragraph."]


def prompts(rng: random.Random, num: int) -> list[str]:
    """`num` distinct prompts (template x topic, arithmetic operands drawn from rng)."""
    pairs = [(tpl, t) for tpl in TEMPLATES for t in TOPICS]
    rng.shuffle(pairs)
    return [tpl.format(t=t, a=rng.randint(12, 999), b=rng.randint(12, 99)) for tpl, t in pairs[:num]]


def bodies(rng: random.Random, num: int) -> list[dict]:
    """Half sampled at 0.7 (seeded), half greedy, over num // 2 distinct prompts."""
    out = []
    for i, text in enumerate(prompts(rng, (num + 1) // 2)):
        for temperature in (0.7, 0.0):
            out.append({"model": "default", "messages": [{"role": "user", "content": text}],
                        "max_tokens": rng.randint(64, 128), "temperature": temperature,
                        "seed": i})
    return out[:num]


async def send_all(url: str, items: list[dict], concurrency: int) -> list[dict]:
    """POST every body to /v1/chat/completions; per item: status, text, error type, message."""
    sem = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, body: dict) -> dict:
        async with sem:
            r = await http.post("/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code == 200:
            choice = data["choices"][0]
            return {"status": 200, "text": choice["message"]["content"],
                    "finish_reason": choice["finish_reason"]}
        return {"status": r.status_code, "error": data["error"]["type"],
                "message": data["error"]["message"]}

    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        return await asyncio.gather(*(one(http, b) for b in items))


def anomaly_counts(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "radixserve:num_anomalies_total"}


def kind_in(message: str) -> str | None:
    return next((k for k in KIND_OF_MODE.values() if f"({k}:" in message), None)


def guard_cost_us_per_char(texts: list[str]) -> float:
    """Mean guard time per character, fed in 4-character deltas."""
    chars, t0 = sum(len(t) for t in texts), time.perf_counter()
    for text in texts:
        guard = AnomalyGuard(GuardConfig())
        for i in range(0, len(text), 4):
            guard.feed(ChoiceUpdate(0, text[i:i + 4]))
    return (time.perf_counter() - t0) / max(chars, 1) * 1e6


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(port),
           "--enable-fault-injection", "--max-total-tokens", "65536", "--context-length", "2048",
           "--max-running-requests", "64", "--log-level", "warning",
           "--anomaly-guard-action", "abort"]
    proc = subprocess.Popen(cmd)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    except RuntimeError as exc:
        proc.kill()
        raise SystemExit(str(exc)) from None
    return proc


def run(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    ordinary = bodies(rng, args.num_ordinary)
    for body in ordinary:
        body["model"] = model
    before = anomaly_counts(url)
    t0 = time.monotonic()
    results = asyncio.run(send_all(url, ordinary, args.concurrency))
    elapsed = time.monotonic() - t0
    after = anomaly_counts(url)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ordinary.jsonl", "w") as f:
        for body, res in zip(ordinary, results):
            f.write(json.dumps({"prompt": body["messages"][0]["content"],
                                "temperature": body["temperature"], **res}) + "\n")
    fired = [r for r in results if r.get("error") == "output_anomaly"]
    summary: dict = {"ordinary": {
        "num": len(results), "num_ok": sum(r["status"] == 200 for r in results),
        "num_false_positives": len(fired),
        "by_kind": {k: sum(kind_in(r["message"]) == k for r in fired) for k in KIND_OF_MODE.values()},
        "metric_delta": {k: after[k] - before.get(k, 0) for k in after},
        "num_greedy_fp": sum(1 for b, r in zip(ordinary, results)
                             if r in fired and b["temperature"] == 0.0),
        "other_errors": sum(r["status"] not in (200, 500) or (r["status"] == 500 and r not in fired)
                            for r in results),
        "mean_chars": sum(len(r.get("text", "")) for r in results) / max(len(results), 1),
        "elapsed_s": round(elapsed, 1)}}
    texts = [r["text"] for r in results if r["status"] == 200]
    summary["guard_us_per_char"] = round(guard_cost_us_per_char(texts), 2)
    summary["corrupt"] = {}
    for mode, kind in KIND_OF_MODE.items():
        httpx.post(f"{url}/admin/fault", json={"kind": "corrupt", "mode": mode}, timeout=60)
        items = [dict(b, model=model) for b in bodies(random.Random(args.seed + 1), args.num_corrupt)]
        try:
            res = asyncio.run(send_all(url, items, args.concurrency))
        finally:
            httpx.delete(f"{url}/admin/fault", timeout=60)
        caught = [r.get("error") == "output_anomaly" for r in res]
        greedy = [b["temperature"] == 0.0 for b in items]
        summary["corrupt"][mode] = {
            "num": len(res), "num_detected": sum(caught),
            "num_detected_as_expected_kind": sum(c and kind_in(r["message"]) == kind
                                                 for c, r in zip(caught, res)),
            "num_greedy": sum(greedy),
            "num_greedy_detected": sum(c and g for c, g in zip(caught, greedy)),
            "missed_chars": [len(r["text"]) for r in res if r["status"] == 200]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running worker (with --enable-fault-injection)")
    parser.add_argument("--num-ordinary", type=int, default=520)
    parser.add_argument("--num-corrupt", type=int, default=60, help="requests per corrupt mode")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/anomaly_guard_bench")
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(port)
        url = f"http://127.0.0.1:{port}"
    try:
        print(json.dumps(run(url, args), indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
