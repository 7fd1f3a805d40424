"""Ops agent soak: a 3-worker fleet idle, then under load with only random step-latency noise (zero findings and actions expected), then a hang (detection and recovery time).

    python benchmarks/agent_soak.py [--idle-s 300] [--noise-s 300] [--model-path DIR] [--sweep-interval-s 5]

Phase 0: the fleet sits idle for --idle-s seconds under the agent (idle pooled connections
are where a client error once passed for a sick worker). Phase 1: every worker gets the `step_latency` fault with jitter (latency_ms +- 30% per
engine step, the ordinary noise of a busy machine) and the fleet serves a client loop for
--noise-s seconds under a supervising agent with default thresholds. Any acting decision
(drain, isolate, restart, undrain, policy change) is a false positive; the script prints them
and exits 1. Through phases 0 and 1 a poller reads the agent's /status every 2 s: a worker
shown with `health_ok: false`, or any finding on the agent's /metrics (`findings_total` by kind),
is a false finding and also fails the run. Phase 2: one worker hangs; the script reads the decision log for the first
drain (detection), the restart and the return to rotation, measured from the injection.
Exit 0 when phases 0 and 1 had no false finding or action and the hung worker came back.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from radixserve.agent.ladder import ACTING

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the a fox dog runs jumps over under quick lazy story river city light night day".split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="worker model (default: the embedded one)")
    p.add_argument("--idle-s", type=float, default=300.0, help="length of the idle phase (s)")
    p.add_argument("--noise-s", type=float, default=300.0, help="length of the noise phase (s)")
    p.add_argument("--noise-latency-ms", type=float, default=20.0, help="added per engine step")
    p.add_argument("--jitter", type=float, default=0.3, help="+- share of the step latency")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--sweep-interval-s", type=float, default=5.0, help="agent sweep (default 5)")
    p.add_argument("--hang-timeout-s", type=float, default=240.0, help="most wait for recovery")
    p.add_argument("--skip-hang", action="store_true",
                   help="end after the noise phase (the CI run: tests/api/test_agent_soak.py)")
    p.add_argument("--num-workers", type=int, default=3, help="fleet size (default 3)")
    p.add_argument("--base-port", type=int, default=32100, help="router; workers from +1")
    p.add_argument("--out-dir", default=None, help="decision log and summary (default: tmp)")
    return p.parse_args()


class Clients:
    """Threads sending non-streamed completions of random length to the router."""

    def __init__(self, url: str, n: int):
        self.url, self.stop, self.results = url, threading.Event(), []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def loop(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120)))
                body = {"prompt": prompt, "max_tokens": rng.randint(8, 48), "temperature": 0.7}
                try:
                    code = http.post("/v1/completions", json=body).status_code
                except httpx.HTTPError as exc:
                    code = type(exc).__name__
                self.results.append((time.time(), code))

    def failures(self, since: float = 0.0, until: float = float("inf")) -> tuple[int, int]:
        window = [c for t, c in self.results if since <= t < until]
        return sum(c != 200 for c in window), len(window)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


class StatusPoller:
    """Reads the agent's /status every `period_s`; keeps the samples where a worker showed
    `health_ok: false` (with its health_error) and the last findings_total by kind."""

    def __init__(self, agent_url: str, period_s: float = 2.0):
        self.url, self.period_s, self.stop = agent_url, period_s, threading.Event()
        self.samples, self.unhealthy = 0, []
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.stop.wait(self.period_s):
                try:
                    status = http.get("/status").json()
                except (httpx.HTTPError, ValueError):
                    continue   # the agent is still starting
                self.samples += 1
                self.unhealthy += [(time.time(), w["url"], w.get("health_error"))
                                   for w in status["workers"] if w.get("health_ok") is False]

    def findings(self) -> dict[str, float]:
        """findings_total by kind from the agent's /metrics (every kind, from 0)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "radixserve_agent:findings_total"}

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)


def wait_until(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout_s} s")
        time.sleep(0.5)


def decisions(log: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def when(d: dict) -> float:
    return datetime.datetime.fromisoformat(d["time"]).timestamp()


def start_fleet(args: argparse.Namespace, out: pathlib.Path) -> tuple[subprocess.Popen, dict]:
    manifest = out / "fleet.json"
    cmd = [sys.executable, "-m", "radixserve", "fleet", "--num-workers", str(args.num_workers), "--manifest",
           str(manifest), "--port", str(args.base_port), "--worker-base-port",
           str(args.base_port + 1), "--log-dir", str(out / "logs"), "--log-level", "warning",
           "--silence-timeout-s", "30", "--enable-fault-injection", "--num-threads", "1",
           "--max-total-tokens", "16384"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    fleet = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 900
    while not manifest.exists():
        if fleet.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"fleet did not start (exit {fleet.poll()})")
        time.sleep(1)
    fleet_info = json.loads(manifest.read_text())
    wait_until(lambda: _all_healthy(fleet_info["router_url"], len(fleet_info["workers"])),
               "the router's health checks to pass on every worker", 120)
    return fleet, fleet_info


def _all_healthy(router_url: str, num_workers: int) -> bool:
    try:
        workers = httpx.get(router_url + "/admin/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return sum(bool(w.get("healthy")) for w in workers) == num_workers


def wait_hang_outcome(log: pathlib.Path, url: str, t_fault: float, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    found: dict[str, float] = {}
    while time.monotonic() < deadline and "undrain" not in found:
        for d in decisions(log):
            if d["worker"] == url and d["action"] in ACTING and when(d) >= t_fault:
                found.setdefault(d["action"], when(d) - t_fault)
        time.sleep(0.5)
    return found


def main() -> int:
    args = parse_args()
    out = pathlib.Path(args.out_dir or tempfile.mkdtemp(prefix="agent-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "decisions.jsonl"
    fleet, manifest = start_fleet(args, out)
    urls = [w["url"] for w in manifest["workers"]]
    agent = clients = poller = None
    try:
        noise = {"kind": "step_latency", "latency_ms": args.noise_latency_ms,
                 "jitter_ms": args.jitter * args.noise_latency_ms}
        for url in urls:
            httpx.post(url + "/admin/fault", json=noise, timeout=10).raise_for_status()
        agent = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "agent", "--router", manifest["router_url"],
             "--supervise", "--fleet-manifest", str(out / "fleet.json"), "--decision-log",
             str(log), "--port", str(args.base_port + 10), "--sweep-interval-s",
             str(args.sweep_interval_s), "--log-level", "warning"], cwd=REPO)
        poller = StatusPoller(f"http://127.0.0.1:{args.base_port + 10}")
        wait_until(lambda: poller.samples > 0, "the agent's first /status", 120)
        time.sleep(args.idle_s)
        idle_findings = poller.findings()
        clients = Clients(manifest["router_url"], args.concurrency)
        t0 = time.time()
        time.sleep(args.noise_s)
        noise_actions = [d for d in decisions(log) if d["action"] in ACTING]
        noise_notes = [d for d in decisions(log) if d["action"] not in ACTING]
        noise_failed = clients.failures(t0)
        quiet_findings = poller.findings()
        poller.finish()
        hung, outcome, hang_failed = urls[1], {}, None
        if not args.skip_hang:
            t_fault = time.time()
            httpx.post(hung + "/admin/fault", json={"kind": "hang"}, timeout=10).raise_for_status()
            outcome = wait_hang_outcome(log, hung, t_fault, args.hang_timeout_s)
            hang_failed = clients.failures(t_fault)
    finally:
        if poller:
            poller.finish()
        if clients:
            clients.finish()
        if agent:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
        stop(fleet, out / "fleet.json")
    false_findings = {k: v for k, v in quiet_findings.items() if v}
    summary = {"idle_s": args.idle_s, "findings after idle": idle_findings,
               "findings after idle + noise": quiet_findings,
               "status samples": poller.samples, "samples with health_ok false": poller.unhealthy,
               "noise_s": args.noise_s, "noise": noise, "sweep_interval_s": args.sweep_interval_s,
               "noise_actions": len(noise_actions), "noise_decisions_logged": len(noise_notes),
               "noise_requests_failed_of": noise_failed, "hang_worker": hung,
               "detection_s (fault -> drain)": outcome.get("drain"),
               "restart_s (fault -> restart)": outcome.get("restart"),
               "recovery_s (fault -> back in rotation)": outcome.get("undrain"),
               "hang_requests_failed_of": hang_failed, "decision_log": str(log)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    for d in noise_actions:
        print("FALSE POSITIVE:", json.dumps(d)[:400])
    for sample in poller.unhealthy:
        print("FALSE UNHEALTHY:", sample)
    ok = not noise_actions and not false_findings and not poller.unhealthy
    return 0 if ok and (args.skip_hang or "undrain" in outcome) else 1


def stop(fleet: subprocess.Popen, manifest: pathlib.Path) -> None:
    """Stop the fleet, then any worker the agent re-spawned (not the fleet's children)."""
    pids = [w["pid"] for w in json.loads(manifest.read_text())["workers"]]
    fleet.send_signal(signal.SIGTERM)
    fleet.wait(60)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main())
