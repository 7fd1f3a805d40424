"""KV checksums (--enable-kv-checksum): catch KV that something overwrote after it was computed.

A slot's KV is *final* once its position is below its request's `num_computed_tokens`: nothing
may write it again until its page returns to the free list. Any later write is corruption: a
prefill->decode transfer landing after its pages were reused (issue 14's race), a host-tier load
into the wrong pages, a page with two owners, the `kv_corrupt` fault. So:

    seal     after each step, every slot that became final gets a checksum: the integer sum of
             its stored bits, K and V, every layer (`KVCache.slot_checksums`; exact, so the same
             bytes always give the same sum and there are no false alarms)
    verify   a sealed slot is recomputed and compared: when a request that maps it is checked
             (each running request every `interval` steps, staggered, skipping slots a check
             compared fewer than `interval` steps ago, so a shared prefix is summed once per
             interval, not once per request; every request when it ends, nothing skipped; a
             radix hit's slots when the request that hit them is first sealed)
    unseal   when its page goes back to the free list (its next owner writes it afresh)

What it cannot see: KV read before it was written (a layer read while its load was still in
flight leaves correct bytes behind) and KV that was wrong when computed; the output-side
detectors (server/anomaly.py) are for those. Side buffers and a draft model's own KV are not
summed. Cost: reading the new slots once (sealing) plus each running request's KV once every
`interval` steps and once at its end (docs/anomaly_guard.md has the measurement).
"""
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
    """Checksums of `num_pages * page_size` slots (slot = page * page_size + offset).
    `checksum(slots)`: slot ids -> their sums, same order (the runner's `kv_slot_checksums`)."""

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
        self.num_checked_slots = 0                 # slots summed so far (sealing and verifying)
        self.num_mismatched_slots = 0

    def unseal(self, page_ids: list[int]) -> None:
        """Pages back on the free list: their slots are no longer final."""
        p = self.page_size
        for page in page_ids:
            self._sealed[page * p:(page + 1) * p] = bytes(p)
            self._verified_at[page * p:(page + 1) * p] = array("q", [_NEVER]) * p

    def after_step(self, requests: list[Request]) -> set[int]:
        """Seal what `requests` (the step's running ones) computed, and verify the sealed KV of
        those whose turn it is (every `interval` steps each). Returns the pages whose checksum
        no longer matches (empty when all is well)."""
        self._step += 1
        slots: list[int] = []
        for req in requests:
            due = (self._step + hash(req.request_id)) % self.interval == 0
            slots += self._slots(req, 0 if due else self._sealed_upto.get(req.request_id, 0))
        return self._check(slots, skip_recent=True)

    def at_end(self, req: Request) -> set[int]:
        """Verify (and seal the rest of) everything `req` computed, before its KV is released.
        Returns the mismatched pages."""
        bad = self._check(self._slots(req, 0))
        self._sealed_upto.pop(req.request_id, None)
        return bad

    def forget(self, req: Request) -> None:
        """`req` released its pages without being checked (aborted)."""
        self._sealed_upto.pop(req.request_id, None)

    def _slots(self, req: Request, start: int) -> list[int]:
        """Slots of `req`'s final positions [start, num_computed_tokens); marks them done."""
        end = req.num_computed_tokens
        self._sealed_upto[req.request_id] = end
        p, slots = self.page_size, []
        for index in range(start // p, -(-end // p)):
            base = req.page_ids[index] * p
            slots += range(base + max(start - index * p, 0), base + min(end - index * p, p))
        return slots

    def _check(self, slots: list[int], skip_recent: bool = False) -> set[int]:
        """Sum `slots`: sealed ones are compared, the others sealed. `skip_recent`: leave out
        sealed slots compared fewer than `interval` steps ago. Returns mismatched pages."""
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
    """The engine's side (engine/hooks.py): seal and verify after each step and at each finish,
    and end every request that maps a mismatched page."""

    def __init__(self, interval: int):
        self.interval = interval
        self.sums: KVChecksums | None = None
        self._failed: list[EngineOutput] = []    # outputs of requests ended by a mismatch
        self._poisoned: set[int] = set()         # mismatched pages the tree could not drop yet

    def attach(self, engine: Any) -> None:
        """Raises ValueError when the runner cannot sum its KV."""
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
        """KV in the `bad` pages was overwritten: end every request that maps one (its output
        carries KV_CHECKSUM_ERROR; `finishing` ends itself) and take the pages out of the radix
        tree (after the step when `finishing` still holds them)."""
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
