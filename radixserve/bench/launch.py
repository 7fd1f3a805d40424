"""Starting servers for benchmark runs: free loopback ports and waiting for /health."""
from __future__ import annotations

import random
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, low: int = 20000, high: int = 32000) -> int:
    """First of n consecutive free loopback ports in [low, high), from a random start; RuntimeError after 200 tries."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high})")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0,
                 name: str = "server") -> None:
    """Poll `url`/health until 200; RuntimeError when `proc` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} ({url}) exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} ({url}) not healthy after {timeout_s} s")
