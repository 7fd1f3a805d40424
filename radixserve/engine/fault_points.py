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
    Engine's `runner`, `scheduler`, `page_size`, `counters`, `_forced` and `_kv_corrupt`."""

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
