"""EngineFaults: the engine process's fault points, attached as engine hooks and armed through one `fault` call."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.chaos.forced_tokens import ForcedTokens, force_run
from radixserve.chaos.kv_corrupt import KVCorruptFault
from radixserve.chaos.pd_faults import POINT_ACTIONS, PDFaults
from radixserve.chaos.tier_faults import AllocFaults, CopyFaults, L3Fault
from radixserve.engine.hooks import EngineHooks
from radixserve.engine.request import Request
from radixserve.errors import InvalidRequest
from radixserve.outputs import EngineOutput, TokenLogprob

KINDS = {"step_latency": ("set_step_latency", "clear_step_latency"),
         "sampler.force_tokens": ("arm_forced_tokens", "disarm_forced_tokens"),
         "kv_corrupt": ("arm_kv_corrupt", "disarm_kv_corrupt"),
         "hicache.h2d.layer": ("arm_hicache_h2d", "disarm_hicache_h2d"),
         "hicache.d2h": ("arm_hicache_d2h", "disarm_hicache_d2h"),
         "hicache.host_alloc": ("arm_hicache_host_alloc", "disarm_hicache_host_alloc"),
         "hicache.l3.get": ("arm_hicache_l3", "disarm_hicache_l3")}


@dataclass(frozen=True, slots=True)
class StepLatency:
    """An injected per-step delay (seconds) until `ends_s` (time.monotonic(); None: no end)."""

    latency_s: float
    jitter_s: float
    ends_s: float | None

    def sleep(self) -> StepLatency | None:
        if self.ends_s is not None and time.monotonic() >= self.ends_s:
            return None
        time.sleep(max(self.latency_s + random.uniform(-self.jitter_s, self.jitter_s), 0.0))
        return self


class EngineFaults(EngineHooks):
    def __init__(self) -> None:
        self.step_latency: StepLatency | None = None
        self.forced: ForcedTokens | None = None
        self.forced_ids: dict[str, tuple[int, ...]] = {}
        self.kv_corrupt: KVCorruptFault | None = None
        self.copy = CopyFaults()
        self.alloc_rng = random.Random(0)
        self.pd: PDFaults | None = None

    def attach(self, engine: Any) -> None:
        self.engine = engine
        engine.counters["num_kv_corruptions"] = 0

    def attach_pd(self, worker: Any) -> None:
        self.pd = worker.faults = PDFaults(self.engine.config.random_seed)

    def fault(self, kind: str, clear: bool = False, **params: Any) -> None:
        """Arm `kind` (replacing one) or clear it; InvalidRequest for an unknown kind or bad params."""
        if kind in POINT_ACTIONS:
            if self.pd is None and not clear:
                raise InvalidRequest(f"fault {kind!r} needs a worker started with "
                                     "--disaggregation-mode prefill|decode", param="kind")
            if clear and self.pd is not None:
                self.pd.disarm(kind)
            elif not clear:
                self.pd.arm(kind, **params)
            return
        if kind not in KINDS:
            raise InvalidRequest(f"unknown engine fault {kind!r}", param="kind")
        arm, disarm = KINDS[kind]
        if clear:
            getattr(self, disarm)()
        else:
            getattr(self, arm)(**params)

    def before_schedule(self) -> None:
        if self.step_latency is not None:
            self.step_latency = self.step_latency.sleep()
        if self.kv_corrupt is None:
            return
        engine = self.engine
        free = engine.kv.pool.free_ids() if self.kv_corrupt.mode == "stale" else []
        hit = self.kv_corrupt.next(engine.scheduler.running, engine.page_size, time.monotonic(), free)
        if hit is not None:
            engine.runner.corrupt_kv(hit.page_ids, hit.mode, hit.source_page_ids, hit.seed)
            engine.counters["num_kv_corruptions"] += 1

    def on_add(self, req: Request) -> None:
        if self.forced is None:
            return
        ids = self.forced.take(req.arrival_s)
        if ids is not None:
            self.forced_ids[req.request_id] = ids
        if self.forced.is_spent:
            self.forced = None

    def on_tokens(self, req: Request, token_ids: list[int], logprobs: Sequence[TokenLogprob] | None
                  ) -> tuple[list[int], Sequence[TokenLogprob] | None]:
        forced = self.forced_ids.get(req.request_id)
        if forced is None:
            return token_ids, logprobs
        return force_run(forced, len(req.output_ids), token_ids, logprobs)

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        self.forced_ids.pop(req.request_id, None)
        return out

    def on_abort(self, req: Request) -> None:
        self.forced_ids.pop(req.request_id, None)

    def set_step_latency(self, latency_ms: float, jitter_ms: float = 0.0,
                         duration_s: float | None = None) -> None:
        ends_s = None if duration_s is None else time.monotonic() + duration_s
        self.step_latency = (StepLatency(latency_ms / 1000, jitter_ms / 1000, ends_s)
                             if latency_ms > 0 or jitter_ms > 0 else None)

    def clear_step_latency(self) -> None:
        self.step_latency = None

    def arm_forced_tokens(self, token_ids: list[int], count: int = 1,
                          duration_s: float | None = None) -> None:
        self.forced = ForcedTokens.armed(token_ids, count, duration_s, self.engine.runner.vocab_size)

    def disarm_forced_tokens(self) -> None:
        self.forced = None   # requests already handed a sequence keep it

    def arm_kv_corrupt(self, mode: str, fraction: float = 0.5, after_tokens: int = 16,
                       count: int = 1, duration_s: float | None = None,
                       seed: int | None = None) -> None:
        if not callable(getattr(self.engine.runner, "corrupt_kv", None)):
            raise InvalidRequest("this runner cannot corrupt KV", param="kind")
        self.kv_corrupt = KVCorruptFault.armed(mode, fraction, after_tokens, count, duration_s, seed)

    def disarm_kv_corrupt(self) -> None:
        self.kv_corrupt = None

    @property
    def kv_corrupt_hits(self) -> list[tuple[str, int]]:
        return list(self.kv_corrupt.hit) if self.kv_corrupt is not None else []

    def _host_tier(self) -> tuple[Any, Any]:
        io, tier = getattr(self.engine.runner, "host_kv", None), self.engine.kv.tier
        if io is None or tier is None or not hasattr(io, "fault"):
            raise InvalidRequest("the host KV tier is off (--enable-hierarchical-cache)", param="kind")
        return io, tier

    def arm_hicache_h2d(self, latency_ms: float = 0.0, jitter_ms: float = 0.0, fail_fraction: float = 0.0,
                        duration_s: float | None = None, skip_wait: str = "none") -> None:
        """`skip_wait` drops the device KV's readiness wait ("side": the index keys only, "all"): test/chaos only."""
        io = self._host_tier()[0]
        io.fault = self.copy
        self.copy.arm_h2d(latency_ms, jitter_ms, fail_fraction, duration_s, skip_wait)
        self._skip_wait(skip_wait)

    def disarm_hicache_h2d(self) -> None:
        self.copy.arm_h2d(0.0, 0.0, 0.0, None)
        self._skip_wait("none")

    def _skip_wait(self, mode: str) -> None:
        kv = getattr(getattr(self.engine.runner, "host_kv", None), "device", None)   # the runner's KVCache
        if kv is not None:
            kv.skip_readiness_wait, kv.skip_side_readiness_wait = mode == "all", mode == "side"

    def arm_hicache_d2h(self, latency_ms: float, duration_s: float | None = None) -> None:
        self._host_tier()[0].fault = self.copy
        self.copy.arm_d2h(latency_ms, duration_s)

    def disarm_hicache_d2h(self) -> None:
        self.copy.arm_d2h(0.0, None)

    def arm_hicache_host_alloc(self, fraction: float = 1.0, duration_s: float | None = None) -> None:
        # duration_s is not enforced: clearing the fault ends it
        self._host_tier()[1].fail_alloc = AllocFaults(fraction, self.alloc_rng)

    def disarm_hicache_host_alloc(self) -> None:
        if self.engine.kv.tier is not None:
            self.engine.kv.tier.fail_alloc = None

    def arm_hicache_l3(self, mode: str, every: int = 1, stall_ms: float = 0.0,
                       duration_s: float | None = None) -> None:
        disk = getattr(self._host_tier()[0], "disk", None)
        if disk is None:
            raise InvalidRequest("the disk KV tier is off (--hicache-storage-dir)", param="kind")
        disk.fetch_limit = L3Fault.armed(mode, every, stall_ms)

    def disarm_hicache_l3(self) -> None:
        disk = getattr(getattr(self.engine.runner, "host_kv", None), "disk", None)
        if disk is not None:
            disk.fetch_limit = None
