"""KV checksums (--enable-kv-checksum): catch KV that something overwrote after it was computed (docs/anomaly_guard.md).

A slot is final once its position is below its request's num_computed_tokens, until its page is freed:
    seal     after each step, each newly final slot gets the exact integer sum of its K and V bits, every layer
    verify   re-sum and compare: each running request every `interval` steps, every request at its end
    unseal   when its page returns to the free list"""
from __future__ import annotations

import dataclasses
import logging
from array import array
from collections.abc import Callable
from typing import Any

from radixserve.engine.hooks import EngineHooks
from radixserve.engine.request import Request
from radixserve.outputs import KV_CHECKSUM_ERROR, EngineOutput

logger = logging.getLogger(__name__)
_NEVER = -(1 << 62)


class KVChecksums:
    """Sums of slots (page * page_size + offset); `checksum(slots)` -> their sums, same order."""

    def __init__(self, num_pages: int, page_size: int, checksum: Callable[[list[int]], list[int]],
                 interval: int):
        self.page_size = page_size
        self.interval = interval
        self._checksum = checksum
        self._sums = array("q", bytes(8 * num_pages * page_size))
        self._sealed = bytearray(num_pages * page_size)
        # step of each slot's last compare (_NEVER: not since it was sealed)
        self._verified_at = array("q", [_NEVER]) * (num_pages * page_size)
        self._sealed_upto: dict[str, int] = {}    # request id -> positions [0, n) sealed or checked
        self._step = 0
        self.num_checked_slots = 0
        self.num_mismatched_slots = 0

    def unseal(self, page_ids: list[int]) -> None:
        p = self.page_size
        for page in page_ids:
            self._sealed[page * p:(page + 1) * p] = bytes(p)
            self._verified_at[page * p:(page + 1) * p] = array("q", [_NEVER]) * p

    def after_step(self, requests: list[Request]) -> set[int]:
        """Seal the step's new KV, verify the requests whose turn it is; returns mismatched pages."""
        self._step += 1
        slots: list[int] = []
        for req in requests:
            due = (self._step + hash(req.request_id)) % self.interval == 0
            slots += self._slots(req, 0 if due else self._sealed_upto.get(req.request_id, 0))
        return self._check(slots, skip_recent=True)

    def at_end(self, req: Request) -> set[int]:
        bad = self._check(self._slots(req, 0))
        self._sealed_upto.pop(req.request_id, None)
        return bad

    def forget(self, req: Request) -> None:
        self._sealed_upto.pop(req.request_id, None)

    def _slots(self, req: Request, start: int) -> list[int]:
        end = req.num_computed_tokens
        self._sealed_upto[req.request_id] = end
        p, slots = self.page_size, []
        for index in range(start // p, -(-end // p)):
            base = req.page_ids[index] * p
            slots += range(base + max(start - index * p, 0), base + min(end - index * p, p))
        return slots

    def _check(self, slots: list[int], skip_recent: bool = False) -> set[int]:
        """Compare sealed slots (`skip_recent`: not those compared within `interval` steps), seal the rest."""
        ids = list(dict.fromkeys(slots))
        sealed, stored, verified_at, step = self._sealed, self._sums, self._verified_at, self._step
        if skip_recent:
            ids = [s for s in ids if not sealed[s] or step - verified_at[s] >= self.interval]
        if not ids:
            return set()
        bad: set[int] = set()
        for slot, value in zip(ids, self._checksum(ids)):
            if not sealed[slot]:
                stored[slot], sealed[slot] = value, 1
                continue
            verified_at[slot] = step
            if stored[slot] != value:
                bad.add(slot // self.page_size)
                self.num_mismatched_slots += 1
        self.num_checked_slots += len(ids)
        return bad


class ChecksumHooks(EngineHooks):
    """Checks after each step and at each finish; ends every request that maps a mismatched page."""

    def __init__(self, interval: int):
        self.interval = interval
        self.sums: KVChecksums | None = None
        self._failed: list[EngineOutput] = []
        self._poisoned: set[int] = set()         # mismatched pages the tree could not drop yet

    def attach(self, engine: Any) -> None:
        checksum = getattr(engine.runner, "kv_slot_checksums", None)
        if checksum is None:
            raise ValueError("--enable-kv-checksum: this runner cannot checksum its KV")
        self.engine = engine
        self.sums = KVChecksums(engine.runner.num_pages, engine.runner.page_size, checksum,
                                self.interval)
        engine.kv.pool.on_free = self.sums.unseal
        engine.counters.update(num_kv_checksum_failures=0, kv_checksum_slots_checked=0,
                               kv_checksum_slots_mismatched=0)

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        self._on_mismatch(self.sums.after_step(running))
        failed, self._failed = self._failed, []
        return failed

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        bad = self.sums.at_end(req)
        self._count()
        if not bad:
            return out
        self._on_mismatch(bad, finishing=req)
        return self._failed_output(out)

    def on_abort(self, req: Request) -> None:
        self.sums.forget(req)

    def _on_mismatch(self, bad: set[int], finishing: Request | None = None) -> None:
        """End every request mapping a `bad` page (`finishing` ends itself) and purge the pages from the tree."""
        bad = bad | self._poisoned
        self._count()
        if not bad:
            return
        logger.warning("KV checksum mismatch in pages %s: ending the requests that read them", sorted(bad))
        readers = [r for r in self.engine.requests.values()
                   if r is not finishing and not bad.isdisjoint(r.page_ids)]
        for req in readers:
            out = self.engine.abort(req.request_id)
            if out is not None:
                self._failed.append(self._failed_output(out))
        self._poisoned = bad if finishing is not None else self.engine.kv.purge(bad)

    def _count(self) -> None:
        c = self.engine.counters
        c["kv_checksum_slots_checked"] = self.sums.num_checked_slots
        c["kv_checksum_slots_mismatched"] = self.sums.num_mismatched_slots

    def _failed_output(self, out: EngineOutput) -> EngineOutput:
        self.engine.counters["num_kv_checksum_failures"] += 1
        return dataclasses.replace(out, finish_reason="abort", error_code=KV_CHECKSUM_ERROR,
                                   error="the request's KV was overwritten after it was computed "
                                         "(KV checksum mismatch)")
