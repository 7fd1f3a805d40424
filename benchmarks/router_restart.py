"""Kill, restart, kill again through the router: in-flight requests, streams and the restarted worker's rejoin (issue 41, item 7).

    PYTHONPATH=. python benchmarks/router_restart.py [--num-plain 6] [--num-streams 9]
        [--gap-s 10] [-- extra router flags]

Starts `radixserve fleet --num-workers 2` over the API tests' tiny random-weight model
(tests/api/router_fixtures.py Fleet) with the router's default health and breaker settings
unless router flags are given. Then:
1. Crash A: `--num-plain` non-streamed requests and `--num-streams` streams are dispatched
   to A (B drained meanwhile, undrained before the kill), then A's process group is SIGKILLed.
2. A is restarted on its port. One health-check interval after its /health first answers
   200, 13 completions are sent at once; the router's view of A and how many A got are printed.
3. `--gap-s` seconds after the restart, the same load is dispatched to B (A drained
   meanwhile) and B is SIGKILLed.
Each crash prints how many non-streamed requests succeeded, how many streams finished clean
and how many ended with an error event, and the router's stream migrations by outcome.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.api.router_fixtures import ADMIN_KEY, Fleet, wait_for  # noqa: E402
from tests.api.conftest import API_KEY  # noqa: E402

PLAIN_TOKENS, STREAM_TOKENS = 300, 400
AFTER_RESTART_REQUESTS = 13
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa").split()


def stream_outcome(http: httpx.Client, prompt: str, started: threading.Semaphore) -> str:
    """"clean" ([DONE], a finish reason, no error event), "error" (an error event), or
    "broken" (anything else: a non-200, a cut connection); `started` is released at the
    first content."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True}
    finish, error, done, content = None, False, False, False
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "broken"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if not content and any(c.get("text") for c in chunk.get("choices", [])):
                    content = True
                    started.release()
                error = error or "error" in chunk
                finish = finish or next((c["finish_reason"] for c in chunk.get("choices", [])
                                         if c.get("finish_reason")), None)
    except httpx.HTTPError:
        return "broken"
    return "error" if error else "clean" if done and finish else "broken"


def migrations(fleet: Fleet) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for f in fleet.metric_samples()
            if f.name == "radixserve_router:stream_migrations" for s in f.samples
            if s.name.endswith("_total")}


def crash(fleet: Fleet, victim: str, other: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load dispatched to `victim` alone, then `victim` SIGKILLed; the outcomes."""
    before = migrations(fleet)
    plain: list[int] = []
    streams: list[str] = []
    lock = threading.Lock()

    def one_plain(i: int) -> None:
        r = fleet.complete(f"plain request {i} after a crash", max_tokens=PLAIN_TOKENS,
                           ignore_eos=True)
        with lock:
            plain.append(r.status_code)

    started = threading.Semaphore(0)

    def one_stream(i: int) -> None:
        outcome = stream_outcome(fleet.http, f"stream {i} that outlives a crash", started)
        with lock:
            streams.append(outcome)
    fleet.admin("POST", "/admin/drain", json={"url": other})
    threads = [threading.Thread(target=one_plain, args=(i,)) for i in range(args.num_plain)]
    threads += [threading.Thread(target=one_stream, args=(i,)) for i in range(args.num_streams)]
    for t in threads:
        t.start()
    total = args.num_plain + args.num_streams
    for _ in range(args.num_streams):     # every stream has sent content: a kill cuts it
        if not started.acquire(timeout=600):
            raise RuntimeError("a stream sent no content")
    wait_for(lambda: fleet.workers()[victim]["in_flight"] >= total, "the load on the victim")
    fleet.admin("POST", "/admin/undrain", json={"url": other})
    in_flight = fleet.workers()[victim]["in_flight"]
    fleet.kill(victim)
    killed_at = time.monotonic()
    for t in threads:
        t.join(600)
    after = migrations(fleet)
    return {"victim": victim, "killed_at": killed_at, "in_flight_at_kill": in_flight,
            "plain_ok": sum(s == 200 for s in plain), "plain": len(plain),
            "streams_clean": streams.count("clean"), "streams_error": streams.count("error"),
            "streams_broken": streams.count("broken"), "streams": len(streams),
            "migrations": {k: v - before.get(k, 0.0) for k, v in after.items()
                           if v - before.get(k, 0.0)}}


def rejoin(fleet: Fleet, url: str, interval_s: float) -> dict[str, Any]:
    """Restart `url`; one health-check interval after its /health answers, the router's view
    of it and its share of AFTER_RESTART_REQUESTS completions sent at once."""
    t0 = time.monotonic()
    fleet.restart(url)
    restart_s = time.monotonic() - t0
    time.sleep(interval_s)
    view = fleet.workers()[url]
    before = fleet.counts()[url]
    prompts = [f"{WORDS[i % len(WORDS)]} {i} after the restart"   # no shared prefix: by load
               for i in range(AFTER_RESTART_REQUESTS)]
    batch = fleet.complete_all(prompts, max_tokens=16, ignore_eos=True)
    return {"restarted": url, "restart_s": round(restart_s, 1), "view_after_one_interval": {k: view[k] for k in (
                "healthy", "breaker", "load", "in_flight")},
            "ok": sum(r.status_code == 200 for r in batch), "sent": len(batch),
            "routed_to_restarted": fleet.counts()[url] - before}


def flag(flags: list[str], name: str, default: float) -> float:
    return float(flags[flags.index(name) + 1]) if name in flags else default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-plain", type=int, default=6)
    p.add_argument("--num-streams", type=int, default=9)
    p.add_argument("--gap-s", type=float, default=10.0, help="restart to second kill")
    p.add_argument("router_flags", nargs="*")
    args = p.parse_args()
    from radixserve.tokenizer.tokenizer import Tokenizer
    from radixserve.weights.paths import resolve_model_path
    from tests.conftest import build_tiny_api_model

    model_dir = pathlib.Path(tempfile.mkdtemp(prefix="router-restart-model-"))
    build_tiny_api_model(model_dir, Tokenizer.load(str(resolve_model_path(None))).hf)
    flags = [*args.router_flags, "--admin-api-key", ADMIN_KEY, "--worker-api-key", API_KEY,
             "--log-level", "warning"]
    interval_s = flag(flags, "--health-check-interval-s", 5.0)
    fleet = Fleet(model_dir, router_flags=flags).wait_ready()
    try:
        a, b = fleet.urls
        first = crash(fleet, a, b, args)
        back = rejoin(fleet, a, interval_s)
        time.sleep(max(0.0, args.gap_s - interval_s))
        second = crash(fleet, b, a, args)
        gap = round(second.pop("killed_at") - first.pop("killed_at"), 1)
        result = {"router_flags": args.router_flags, "first_crash": first, "rejoin": back,
                  "second_crash": second, "first_to_second_kill_s": gap}
        print(json.dumps(result, indent=1))
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
