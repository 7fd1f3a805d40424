"""`radixserve fleet --num-workers N | --num-prefill N --num-decode M [router flags] [worker flags]`: workers plus a router on one machine."""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

import httpx

from radixserve.config import add_dataclass_args, from_args
from radixserve.http_common import PortUnavailable, bind_socket, setup_logging
from radixserve.router.config import RouterConfig

logger = logging.getLogger("radixserve.fleet")

#: A stopped worker is SIGKILLed this long (s) after its --graceful-shutdown-timeout.
STOP_MARGIN_S = 10.0
PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """SIGINT or SIGTERM arrived while the fleet was starting."""


@dataclass
class WorkerProc:

    url: str
    argv: list[str]
    log_path: str
    proc: subprocess.Popen
    log: IO[Any]

    def to_json(self) -> dict:
        return {"url": self.url, "pid": self.proc.pid, "argv": self.argv, "log": self.log_path}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve fleet", allow_abbrev=False,
        description="Start N `radixserve serve` workers and a router in front of them; flags "
                    "not listed here go to every worker (e.g. --model-path). Ctrl-C or SIGTERM "
                    "stops them all: the router drains first, then the workers, each for up to "
                    "--graceful-shutdown-timeout seconds.")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--num-workers", type=int, default=None,
                       help="colocated workers to start (or --num-prefill and --num-decode)")
    fleet.add_argument("--num-prefill", type=int, default=0,
                       help="PD mode: prefill workers (--disaggregation-mode prefill; their "
                            "bootstrap ports follow the last worker port)")
    fleet.add_argument("--num-decode", type=int, default=0,
                       help="PD mode: decode workers (--disaggregation-mode decode)")
    fleet.add_argument("--worker-base-port", type=int, default=None,
                       help="worker i listens on this + i (default: the router's --port + 1, so "
                            "--port alone moves the whole fleet)")
    fleet.add_argument("--worker-host", default="127.0.0.1",
                       help="workers' listen address (default: 127.0.0.1)")
    fleet.add_argument("--manifest", default=None,
                       help="write {router_url, workers: [{url, pid, argv, log}]} here (JSON) "
                            "once every worker is healthy")
    fleet.add_argument("--log-dir", default=None,
                       help="folder for worker logs (default: a new temporary folder)")
    fleet.add_argument("--startup-timeout-s", type=float, default=600.0,
                       help="most seconds to wait for every worker's /health (default: 600)")
    add_dataclass_args(parser.add_argument_group("router"), RouterConfig)
    return parser


def _die_with_parent() -> None:
    """preexec: SIGTERM the child when the fleet dies (Linux PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_worker(argv: list[str], url: str, log_path: str) -> WorkerProc:
    log = open(log_path, "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent)
    return WorkerProc(url, argv, log_path, proc, log)


def worker_commands(args: argparse.Namespace, config: RouterConfig,
                    worker_args: list[str]) -> list[tuple[str, list[str]]]:
    """(URL, argv) of each worker, on ports from --worker-base-port (default --port + 1), with the router's log level,
    --graceful-shutdown-timeout and --request-body-timeout. Raises ValueError when a port would pass 65535."""
    roles = worker_roles(args)
    base = config.port + 1 if args.worker_base_port is None else args.worker_base_port
    last = base + len(roles) - 1 + roles.count("prefill")
    if last > 65535:
        raise ValueError(f"worker ports {base}..{last} pass 65535; "
                         f"choose a lower --port or --worker-base-port")
    commands = []
    bootstrap_port = base + len(roles)
    for port, role in zip(range(base, base + len(roles)), roles):
        cmd = [sys.executable, "-m", "radixserve", "serve", *worker_args,
               "--host", args.worker_host, "--port", str(port), "--log-level", config.log_level,
               "--graceful-shutdown-timeout", f"{config.graceful_shutdown_timeout:g}",
               "--request-body-timeout", f"{config.request_body_timeout:g}",
               "--request-read-timeout", f"{config.request_read_timeout:g}",
               "--max-request-body-bytes", str(config.max_request_body_bytes)]
        if role != "null":
            cmd += ["--disaggregation-mode", role]
        if role == "prefill":
            cmd += ["--disaggregation-bootstrap-host", args.worker_host,
                    "--disaggregation-bootstrap-port", str(bootstrap_port)]
            bootstrap_port += 1
        commands.append((f"http://{args.worker_host}:{port}", cmd))
    return commands


def worker_roles(args: argparse.Namespace) -> list[str]:
    """Raises ValueError unless exactly one of --num-workers, --num-prefill + --num-decode is given, each >= 1."""
    pd = args.num_prefill or args.num_decode
    if pd and args.num_workers is not None:
        raise ValueError("give --num-workers, or --num-prefill and --num-decode, not both")
    if pd:
        if args.num_prefill < 1 or args.num_decode < 1:
            raise ValueError("PD mode needs --num-prefill >= 1 and --num-decode >= 1")
        return ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
    if args.num_workers is None or args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    return ["null"] * args.num_workers


def check_ports(config: RouterConfig, worker_host: str, worker_urls: list[str]) -> None:
    """Raises PortUnavailable (a RuntimeError) for the first of the fleet's ports taken."""
    try:
        bind_socket(config.host, config.port).close()
    except PortUnavailable as exc:
        raise PortUnavailable(f"router: {exc} (choose another port with --port)") from None
    for i, url in enumerate(worker_urls):
        try:
            bind_socket(worker_host, int(url.rpartition(":")[2])).close()
        except PortUnavailable as exc:
            raise PortUnavailable(f"worker {i}: {exc} (move the workers with --worker-base-port, "
                                  f"or the whole fleet with --port)") from None


def wait_healthy(workers: list[WorkerProc], timeout_s: float) -> None:
    """Raises RuntimeError if a worker exits or is not healthy within timeout_s."""
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.url} exited with {w.proc.returncode} during "
                                   f"start-up; see {w.log_path}")
            try:
                if httpx.get(w.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(w)
                    logger.info("fleet: worker %s is up (%d of %d)", w.url,
                                len(workers) - len(pending), len(workers))
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy after {timeout_s} s: "
                               f"{[w.url for w in pending]}")
        if pending:
            time.sleep(0.1)


def stop_workers(workers: list[WorkerProc], grace_s: float) -> None:
    """SIGTERM every worker's group; SIGKILL what is left after grace_s + STOP_MARGIN_S."""
    if workers:
        logger.info("fleet: stopping %d worker(s): SIGTERM, requests in flight get up to %g s "
                    "(--graceful-shutdown-timeout), SIGKILL after %g s", len(workers), grace_s,
                    grace_s + STOP_MARGIN_S)
    for w in workers:
        _kill_group(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + STOP_MARGIN_S
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("worker %s still running %g s after SIGTERM; killing it", w.url,
                           grace_s + STOP_MARGIN_S)
        _kill_group(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
        w.log.close()


def stop_adopted(manifest_path: str | None, workers: list[WorkerProc], grace_s: float) -> None:
    """Stop, as stop_workers does, the manifest's workers this fleet did not start (restarted by the ops agent)."""
    if not manifest_path or not os.path.exists(manifest_path):
        return
    ours = {w.proc.pid for w in workers}
    adopted = [pid for pid in manifest_pids(manifest_path) if pid not in ours]
    for pid in adopted:
        _kill_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + STOP_MARGIN_S
    for pid in adopted:
        while time.monotonic() < deadline and _group_alive(pid):
            time.sleep(0.1)
        _kill_group(pid, signal.SIGKILL)


def manifest_pids(manifest_path: str) -> list[int]:
    """The manifest's worker pids (none if unreadable), except pids <= 1 and our group (killpg: init, the fleet)."""
    try:
        with open(manifest_path) as f:
            body = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("fleet: cannot read manifest %s to stop restarted workers: %r",
                       manifest_path, exc)
        return []
    entries = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        logger.warning("fleet: manifest %s has no list of workers; stopping no restarted ones",
                       manifest_path)
        return []
    pids = [e.get("pid") if isinstance(e, dict) else None for e in entries]
    good = [pid for pid in pids if type(pid) is int and pid > 1 and pid != os.getpgrp()]
    if len(good) < len(pids):
        logger.warning("fleet: manifest %s: skipped %d worker entries without a usable pid",
                       manifest_path, len(pids) - len(good))
    return good


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        logger.debug("process group %d already gone", pid)


def _group_alive(pid: int) -> bool:
    """Whether group `pid` has a non-zombie member (killpg(pid, 0) succeeds on a zombie)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def write_manifest(path: str, router_url: str, workers: list[WorkerProc]) -> None:
    body = {"router_url": router_url, "workers": [w.to_json() for w in workers]}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """`radixserve fleet`: 0 after a clean stop, 1 if start-up failed, 2 on bad flags."""
    from radixserve.router.cli import run

    parser = build_parser()
    args, worker_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        config = from_args(RouterConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        commands = worker_commands(args, config, worker_args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(config.log_level)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="radixserve-fleet-")
    os.makedirs(log_dir, exist_ok=True)

    def on_signal(sig: int, frame: object) -> None:
        raise Stop(f"signal {sig}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    workers: list[WorkerProc] = []
    try:
        check_ports(config, args.worker_host, [url for url, _ in commands])
        logger.info("fleet: starting %d workers on %s (logs in %s)", len(commands),
                    ", ".join(url for url, _ in commands), log_dir)
        for i, (url, cmd) in enumerate(commands):
            workers.append(spawn_worker(cmd, url, os.path.join(log_dir, f"worker-{i}.log")))
        wait_healthy(workers, args.startup_timeout_s)
        router_url = f"http://{config.host}:{config.port}"
        if args.manifest:
            write_manifest(args.manifest, router_url, workers)
        logger.info("fleet: %d workers healthy (logs in %s); router on %s",
                    len(workers), log_dir, router_url)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if args.num_prefill:
            urls = [w.url for w in workers]
            return run(config, [], urls[:args.num_prefill], urls[args.num_prefill:])
        return run(config, [w.url for w in workers])
    except Stop as exc:
        logger.info("fleet: stopping during start-up (%s)", exc)
        return 0
    except RuntimeError as exc:
        logger.error("fleet: %s", exc)
        return 1
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        stop_adopted(args.manifest, workers, config.graceful_shutdown_timeout)
        stop_workers(workers, config.graceful_shutdown_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)
