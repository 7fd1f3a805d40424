"""The engine's fault points (--enable-fault-injection, through the worker's /admin/fault): forced tokens and KV corruption.

A mixin of Engine, so that the engine module keeps to scheduling and output; the faults
themselves are in forced_tokens.py and kv_corrupt.py.
"""
from __future__ import annotations

import time

from radixserve.engine.forced_tokens import ForcedTokens
from radixserve.engine.kv_corrupt import KVCorruptFault
from radixserve.errors import InvalidRequest


class FaultPoints:
    """Engine methods that arm and disarm the engine-side faults (see module doc). Expects the
    Engine's `runner`, `scheduler`, `kv`, `page_size`, `counters`, `_forced` and `_kv_corrupt`."""

    def arm_forced_tokens(self, token_ids: list[int], count: int = 1,
                          duration_s: float | None = None) -> None:
        """Fault point sampler.force_tokens (forced_tokens.py): the next `count` requests added
        emit `token_ids` (for `duration_s` seconds at most; None: until used up). Replaces an
        armed one. Raises InvalidRequest for an empty list, an id outside the vocabulary, or
        count < 1."""
        self._forced = ForcedTokens.armed(token_ids, count, duration_s, self.runner.vocab_size)

    def disarm_forced_tokens(self) -> None:
        """End the sampler.force_tokens fault; requests already handed a sequence keep it."""
        self._forced = None

    def arm_kv_corrupt(self, mode: str, fraction: float = 0.5, after_tokens: int = 16,
                       count: int = 1, duration_s: float | None = None,
                       seed: int | None = None) -> None:
        """Fault point kv_corrupt (kv_corrupt.py): the next `count` running requests with at
        least `after_tokens` generated tokens get `fraction` of their KV pages overwritten
        (`mode` noise or swap). Replaces an armed one. Raises InvalidRequest for a bad mode or
        number, or when the runner cannot overwrite KV."""
        if not callable(getattr(self.runner, "corrupt_kv", None)):
            raise InvalidRequest("this runner cannot corrupt KV", param="kind")
        self._kv_corrupt = KVCorruptFault.armed(mode, fraction, after_tokens, count, duration_s, seed)

    def arm_pd_fault(self, point: str, action: str, **kwargs) -> None:
        """PD fault points exist on prefill and decode workers only (disagg/engine.py)."""
        raise InvalidRequest(f"fault {point!r} needs a worker started with "
                             "--disaggregation-mode prefill|decode", param="kind")

    def disarm_pd_fault(self, point: str | None = None) -> None:
        """Nothing is armed on a colocated worker."""

    # ---- host KV tier (runner/host_kv.py, engine/hicache.py) ---------------------------------
    def _host_tier(self):
        io, tier = getattr(self.runner, "host_kv", None), self.kv.tier
        if io is None or tier is None or not hasattr(io, "faults"):
            raise InvalidRequest("the host KV tier is off (--enable-hierarchical-cache)", param="kind")
        return io, tier

    def arm_hicache_h2d(self, latency_ms: float = 0.0, jitter_ms: float = 0.0,
                        fail_fraction: float = 0.0, duration_s: float | None = None) -> None:
        """Fault point hicache.h2d.layer: each layer of each host->device load waits
        latency_ms (uniform +- jitter_ms) and fails with probability fail_fraction (the load is
        then recomputed). Raises InvalidRequest when the tier is off."""
        faults = self._host_tier()[0].faults
        faults.h2d_delay_ms, faults.h2d_jitter_ms = latency_ms, jitter_ms
        faults.h2d_fail_probability = fail_fraction
        faults.h2d_until_s = None if duration_s is None else time.monotonic() + duration_s

    def disarm_hicache_h2d(self) -> None:
        self.arm_hicache_h2d()

    def arm_hicache_d2h(self, latency_ms: float, duration_s: float | None = None) -> None:
        """Fault point hicache.d2h: every device->host backup takes latency_ms longer."""
        faults = self._host_tier()[0].faults
        faults.d2h_delay_ms = latency_ms
        faults.d2h_until_s = None if duration_s is None else time.monotonic() + duration_s

    def disarm_hicache_d2h(self) -> None:
        self.arm_hicache_d2h(0.0)

    def arm_hicache_host_alloc(self, fraction: float = 1.0, duration_s: float | None = None) -> None:
        """Fault point hicache.host_alloc: that share of host page allocations fails (the
        copy is skipped, C31). `duration_s` is not enforced here: clear the fault to end it."""
        self._host_tier()[1].alloc_fail_probability = fraction

    def disarm_hicache_host_alloc(self) -> None:
        if self.kv.tier is not None:
            self.kv.tier.alloc_fail_probability = 0.0

    def arm_hicache_l3(self, mode: str, every: int = 1, stall_ms: float = 0.0,
                       duration_s: float | None = None) -> None:
        """Fault point hicache.l3.get (runner/disk_kv.py): one disk fetch in `every` fails
        (mode fail), loses its second half (fail_chunk, short) or first stalls stall_ms
        (stall). Raises InvalidRequest without a disk tier or for a bad mode."""
        disk = getattr(self._host_tier()[0], "disk", None)
        if disk is None:
            raise InvalidRequest("the disk KV tier is off (--hicache-storage-dir)", param="kind")
        try:
            disk.arm_fault(mode, every, stall_ms)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="mode") from None

    def disarm_hicache_l3(self) -> None:
        disk = getattr(getattr(self.runner, "host_kv", None), "disk", None)
        if disk is not None:
            disk.arm_fault(None)

    def disarm_kv_corrupt(self) -> None:
        """End the kv_corrupt fault (KV already overwritten stays so)."""
        self._kv_corrupt = None

    @property
    def kv_corrupt_hits(self) -> list[tuple[str, int]]:
        """(request id, output tokens it had) of each request the armed kv_corrupt fault hit."""
        return list(self._kv_corrupt.hit) if self._kv_corrupt is not None else []

    def _apply_kv_corrupt(self) -> None:
        """Before a step: overwrite the KV of the request the armed kv_corrupt fault picks now."""
        if self._kv_corrupt is None:
            return
        hit = self._kv_corrupt.next(self.scheduler.running, self.page_size, time.monotonic())
        if hit is not None:
            self.runner.corrupt_kv(hit.page_ids, hit.mode, hit.source_page_ids, hit.seed)
            self.counters["num_kv_corruptions"] += 1
