"""Fault points of the KV tiers (docs/hicache.md): CopyFaults (HostKV.fault), AllocFaults (HostTier.fail_alloc), L3Fault (DiskKV.fetch_limit)."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from radixserve.errors import InvalidRequest

L3_MODES = ("fail", "fail_chunk", "short", "stall")
# hicache.h2d.layer's skip_wait: reads wait for loads (none), all but side-buffer reads wait (side), none wait (all).
SKIP_WAIT = ("none", "side", "all")


@dataclass
class CopyFaults:
    """`hold` (tests) blocks a load until set; `*_until_s`: time.monotonic() end or None; `skip_wait` (SKIP_WAIT):
    which device KV reads stop waiting for a load in flight, "side" reproducing GLM-5's indexer race."""

    h2d_delay_ms: float = 0.0
    h2d_jitter_ms: float = 0.0
    h2d_fail_probability: float = 0.0
    h2d_until_s: float | None = None
    d2h_delay_ms: float = 0.0
    d2h_until_s: float | None = None
    rng: random.Random = field(default_factory=random.Random)
    hold: threading.Event | None = None
    skip_wait: str = "none"

    def arm_h2d(self, latency_ms: float, jitter_ms: float, fail_fraction: float,
                duration_s: float | None, skip_wait: str = "none") -> None:
        if skip_wait not in SKIP_WAIT:
            raise InvalidRequest(f"hicache.h2d.layer takes skip_wait {SKIP_WAIT}", param="skip_wait")
        self.skip_wait = skip_wait
        self.h2d_delay_ms, self.h2d_jitter_ms = latency_ms, jitter_ms
        self.h2d_fail_probability = fail_fraction
        self.h2d_until_s = None if duration_s is None else time.monotonic() + duration_s

    def arm_d2h(self, latency_ms: float, duration_s: float | None) -> None:
        self.d2h_delay_ms = latency_ms
        self.d2h_until_s = None if duration_s is None else time.monotonic() + duration_s

    @staticmethod
    def _on(until_s: float | None) -> bool:
        return until_s is None or time.monotonic() < until_s

    def before_load_layer(self, layer: int) -> None:
        if layer == 0 and self.hold is not None:
            self.hold.wait()
        if not self._on(self.h2d_until_s):
            return
        ms = self.h2d_delay_ms + (self.rng.uniform(-self.h2d_jitter_ms, self.h2d_jitter_ms)
                                  if self.h2d_jitter_ms else 0.0)
        if ms > 0:
            time.sleep(ms / 1000)
        if self.h2d_fail_probability > 0 and self.rng.random() < self.h2d_fail_probability:
            raise RuntimeError("injected fault hicache.h2d.layer")

    def before_backup(self) -> None:
        if self.d2h_delay_ms and self._on(self.d2h_until_s):
            time.sleep(self.d2h_delay_ms / 1000)


class AllocFaults:
    def __init__(self, fraction: float, rng: random.Random):
        self.fraction, self.rng = fraction, rng

    def __call__(self) -> bool:
        return bool(self.fraction) and self.rng.random() < self.fraction


@dataclass
class L3Fault:
    """One fetch in `every` lands no page (fail), half (fail_chunk, short), or all after stall_ms (stall)."""

    mode: str
    every: int = 1
    stall_ms: float = 0.0
    seen: int = 0

    @classmethod
    def armed(cls, mode: str, every: int = 1, stall_ms: float = 0.0) -> L3Fault:
        if mode not in L3_MODES or every < 1:
            raise InvalidRequest(f"hicache.l3.get takes mode {L3_MODES} and every >= 1", param="mode")
        return cls(mode, every, stall_ms)

    def __call__(self, n: int) -> int:
        self.seen += 1
        if self.seen % self.every:
            return n
        if self.mode == "stall":
            time.sleep(self.stall_ms / 1000)
            return n
        return {"fail": 0, "fail_chunk": n // 2, "short": (n + 1) // 2}[self.mode]
