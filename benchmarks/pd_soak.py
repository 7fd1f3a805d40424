"""PD soak: verifiable prompts through a 1P1D pair under random injected delays and 10 % random client aborts, every output compared with a colocated cold reference.

    python benchmarks/pd_soak.py --launch [--model-path DIR] [--num-requests 10000] [--concurrency 48]
    python benchmarks/pd_soak.py --router-url URL --reference-url URL --prefill-url URL --decode-url URL

Each prompt carries its own secret code ("Memorise this: the code is 48213907. <2-6 pages of
filler> Repeat the code:", as the C-case tests do). The reference server (colocated, cache
flushed first) answers every prompt once, greedy, with top-2 logprobs. Then the pair serves
them at --concurrency with `pd.transfer.write`, `pd.prefill.start` and `pd.decode.prealloc`
delays armed (random, U(0, --max-delay-ms)), and --abort-fraction of requests are dropped by the
client after U(0, --abort-within-s) seconds. Each completed output is judged as
radixserve.bench.check does (identical / tie / corrupted: first differing position and its
top-2 gap); an output holding another request's code is cross-talk. After the run both
workers must be idle with no page in use and nothing quarantined. Exit 0 only with 0 corrupted,
0 cross-talk, 0 leaked pages and no 5xx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from radixserve.bench.check import TIE_GAP, compare  # noqa: E402
from radixserve.bench.metrics import RequestResult  # noqa: E402

WORDS = ("the river city light night day story quick lazy fox dog runs over under bridge "
         "garden window paper stone cloud music table winter summer market").split()
FAULTS = ("pd.transfer.write", "pd.prefill.start", "pd.decode.prealloc")


@dataclass
class Prompt:
    index: int
    code: str
    text: str


def make_prompts(n: int, seed: int, words_lo: int = 25, words_hi: int = 90) -> list[Prompt]:
    """n verifiable prompts: a 6-8 digit code, filler of U(words_lo, words_hi) words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        code = str(rng.randrange(10 ** (rng.randint(6, 8) - 1), 10 ** 8))
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(words_lo, words_hi)))
        out.append(Prompt(i, code, f"Memorise this: the code is {code}. {filler}. Repeat the code:"))
    return out


def _result(index: int, body: dict | None, error: str = "") -> RequestResult:
    r = RequestResult(prompt_len=0, index=index, error=error, success=body is not None)
    if body is not None:
        lp = body["choices"][0]["logprobs"]
        r.tokens = lp["tokens"]
        r.top2_gaps = [_gap(list(t.values())) if t else None for t in lp["top_logprobs"]]
        r.generated_text = body["choices"][0]["text"]
    return r


def _gap(values: list[float]) -> float | None:
    top = sorted(values, reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


async def _complete(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> httpx.Response:
    return await http.post(url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2})


async def reference_run(url: str, prompts: list[Prompt], max_tokens: int, concurrency: int) -> dict:
    """{index: {"tokens", "gaps"}} from the reference server (after /flush_cache)."""
    async with httpx.AsyncClient(timeout=600) as http:
        await http.post(url + "/flush_cache")
        sem = asyncio.Semaphore(concurrency)

        async def one(p: Prompt) -> RequestResult:
            async with sem:
                r = await _complete(http, url, p.text, max_tokens)
                return _result(p.index, r.json() if r.status_code == 200 else None, r.text)
        results = await asyncio.gather(*(one(p) for p in prompts))
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"reference failed {len(bad)} requests: {bad[0].error[:300]}")
    return {r.index: {"index": r.index, "tokens": r.tokens, "gaps": r.top2_gaps} for r in results}


async def pd_run(router_url: str, prompts: list[Prompt], max_tokens: int, concurrency: int,
                 abort_fraction: float, abort_within_s: float, seed: int) -> tuple[list, dict]:
    """(results of completed requests, {"aborted", "status_<code>": n})."""
    rng = random.Random(seed + 1)
    counts: dict[str, int] = {"aborted": 0}
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 2)) as http:
        async def one(p: Prompt) -> None:
            abort_after = rng.uniform(0, abort_within_s) if rng.random() < abort_fraction else None
            async with sem:
                task = asyncio.ensure_future(_complete(http, router_url, p.text, max_tokens))
                try:
                    r = await asyncio.wait_for(task, abort_after) if abort_after else await task
                except asyncio.TimeoutError:   # the client goes away: both legs must clean up
                    counts["aborted"] += 1
                    return
            counts[f"status_{r.status_code}"] = counts.get(f"status_{r.status_code}", 0) + 1
            results.append(_result(p.index, r.json() if r.status_code == 200 else None, r.text[:300]))
            if r.status_code != 200:   # each failure's answer, for the post-mortem
                print(f"request {p.index}: {r.status_code} {r.text[:300]}", file=sys.stderr)
        await asyncio.gather(*(one(p) for p in prompts))
    return results, counts


def crosstalk(prompts: list[Prompt], results: list[RequestResult]) -> int:
    """Outputs that contain a code of another request of the run."""
    codes = {p.code: p.index for p in prompts}
    hits = 0
    for r in results:
        for code in re.findall(r"\d{6,8}", r.generated_text):
            if codes.get(code, r.index) != r.index:
                hits += 1
                break
    return hits


def arm_faults(url: str, max_delay_ms: float, points: tuple[str, ...]) -> None:
    for point in points:
        r = httpx.post(url + "/admin/fault", json={"kind": point, "action": "delay",
                                                   "delay_ms": 0, "delay_max_ms": max_delay_ms,
                                                   "probability": 0.5}, timeout=30)
        r.raise_for_status()


def leak_report(url: str, wait_s: float = 60.0) -> dict:
    """The worker's page state once idle (or after wait_s): in-use and quarantined pages."""
    deadline = time.monotonic() + wait_s
    while True:
        pages = httpx.get(url + "/debug/pages", timeout=30).json()
        pd = httpx.get(url + "/get_server_info", timeout=30).json()["engine"]["pd"]
        idle = pages["num_in_use_pages"] == 0 and pd["num_quarantined_pages"] == 0
        if idle or time.monotonic() > deadline:
            return {"in_use_pages": pages["num_in_use_pages"], "invariant": pages["invariant_holds"],
                    "quarantined_pages": pd["num_quarantined_pages"],
                    "late_writes_refused": pd["late_writes_refused"],
                    "late_writes_landed": pd["late_writes_landed"],
                    "transfers": {k: pd[f"transfers_{k}"] for k in ("succeeded", "failed", "aborted")}}
        time.sleep(0.5)


def soak(router_url: str, reference_url: str, prefill_url: str, decode_url: str,
         num_requests: int, concurrency: int, max_tokens: int = 16, abort_fraction: float = 0.1,
         abort_within_s: float = 2.0, max_delay_ms: float = 50.0, seed: int = 0,
         words: tuple[int, int] = (25, 90)) -> dict:
    """One soak run; returns its report (module doc). `ok` is the pass/fail verdict."""
    prompts = make_prompts(num_requests, seed, *words)
    t0 = time.monotonic()
    reference = asyncio.run(reference_run(reference_url, prompts, max_tokens, concurrency))
    arm_faults(prefill_url, max_delay_ms, FAULTS[:2])
    arm_faults(decode_url, max_delay_ms, FAULTS[2:])
    t1 = time.monotonic()
    try:
        results, counts = asyncio.run(pd_run(router_url, prompts, max_tokens, concurrency,
                                             abort_fraction, abort_within_s, seed))
    finally:
        for url in (prefill_url, decode_url):
            httpx.delete(url + "/admin/fault", timeout=30)
    t2 = time.monotonic()
    check = compare(reference, results, TIE_GAP)
    leaks = {"prefill": leak_report(prefill_url), "decode": leak_report(decode_url)}
    server_errors = sum(n for k, n in counts.items() if k.startswith("status_5"))
    report = {"num_requests": num_requests, "concurrency": concurrency, **counts,
              "check": {k: v for k, v in check.items() if k != "first_corrupted"},
              "first_corrupted": check["first_corrupted"], "crosstalk": crosstalk(prompts, results),
              "workers": leaks, "reference_s": round(t1 - t0, 1), "pd_s": round(t2 - t1, 1)}
    report["ok"] = (check["corrupted"] == 0 and report["crosstalk"] == 0 and server_errors == 0
                    and all(w["in_use_pages"] == 0 and w["quarantined_pages"] == 0 and w["invariant"]
                            and w["late_writes_landed"] == 0 for w in leaks.values()))
    return report


def launch(model_path: str | None, log_dir: pathlib.Path, num_threads: int | None = None,
           log_level: str = "warning") -> tuple[list[subprocess.Popen], dict]:
    """Start a reference worker, a prefill and a decode worker and a PD router on loopback
    (each worker with --num-threads `num_threads` when given; every process at `log_level`,
    the workers' logs under `log_dir`, the router's in `log_dir`/router.log)."""
    from radixserve.bench.launch import free_ports
    base = free_ports(6)
    model = ["--model-path", model_path] if model_path else []
    threads = ["--num-threads", str(num_threads)] if num_threads else []
    common = [*model, *threads, "--max-total-tokens", "65536", "--enable-debug-endpoints",
              "--log-level", log_level]
    urls = {name: f"http://127.0.0.1:{base + i}" for i, name in enumerate(("reference", "prefill", "decode", "router"))}
    cmds = {
        "reference": ["serve", *common, "--port", str(base)],
        "prefill": ["serve", *common, "--port", str(base + 1), "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(base + 4), "--enable-fault-injection"],
        "decode": ["serve", *common, "--port", str(base + 2), "--disaggregation-mode", "decode",
                   "--enable-fault-injection"],
    }
    procs = []
    for name, args in cmds.items():
        log = open(log_dir / f"{name}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "radixserve", *args], cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT))
    for name in cmds:
        _wait(urls[name] + "/health")
    router_log = open(log_dir / "router.log", "w")
    procs.append(subprocess.Popen([sys.executable, "-m", "radixserve", "route", "--prefill",
                                   urls["prefill"], "--decode", urls["decode"], "--port",
                                   str(base + 3), "--log-level", log_level], cwd=REPO,
                                  stdout=router_log, stderr=subprocess.STDOUT))
    _wait(urls["router"] + "/health")
    return procs, urls


def _wait(url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", action="store_true", help="start the workers and router here")
    p.add_argument("--model-path", default=None, help="with --launch (default: the embedded model)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="with --launch: each worker's torch threads (1 suits a tiny model)")
    p.add_argument("--log-level", default="warning", help="with --launch: the workers' and router's")
    for name in ("router", "reference", "prefill", "decode"):
        p.add_argument(f"--{name}-url")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--abort-within-s", type=float, default=2.0)
    p.add_argument("--max-delay-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    procs: list[subprocess.Popen] = []
    if args.launch:
        import tempfile
        log_dir = pathlib.Path(tempfile.mkdtemp(prefix="pd-soak-"))
        procs, urls = launch(args.model_path, log_dir, args.num_threads, args.log_level)
        print(f"logs in {log_dir}", file=sys.stderr)
    else:
        urls = {n: getattr(args, f"{n}_url") for n in ("router", "reference", "prefill", "decode")}
        if not all(urls.values()):
            p.error("give --launch, or all four URLs")
    try:
        report = soak(urls["router"], urls["reference"], urls["prefill"], urls["decode"],
                      args.num_requests, args.concurrency, args.max_tokens, args.abort_fraction,
                      args.abort_within_s, args.max_delay_ms, args.seed)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
