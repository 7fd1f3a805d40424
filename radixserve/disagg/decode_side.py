"""Decode side of PD: page preallocation, landing writes, and the waiting half of the abort handshake.

Invariant (docs/disaggregation.md): a page a KVWrite may still target (room WAITING_FOR_KV or
quarantined) is owned by that room alone and is freed only on SafeToFree / PrefillFailed."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixserve.disagg.api import SideHost
from radixserve.disagg.protocol import (AbortRoom, Expect, KVDone, KVLayout, KVWrite, PDTarget,
                                        PrefillFailed, SafeToFree, prompt_crc)
from radixserve.disagg.transport import TransportError
from radixserve.engine.request import Request, Status
from radixserve.errors import InvalidRequest

logger = logging.getLogger(__name__)

QUARANTINE_TIMEOUT_FACTOR = 5   # unanswered quarantined pages are freed after this many transfer timeouts


@dataclass(slots=True, eq=False)
class Incoming:
    req: Request
    target: PDTarget
    due_s: float | None = None            # pd.decode.prealloc hold: delay (due_s) or hang (hang_gen)
    hang_gen: int | None = None
    expect_s: float | None = None         # when Expect went out (None: still preallocating)
    landed: set[int] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Quarantined:
    room: int
    page_ids: list[int]
    since_s: float
    num_tree_pages: int = 0


class DecodeSide:
    def __init__(self, worker: SideHost, endpoint, layout: KVLayout):
        self.worker = worker
        self.engine = worker.engine
        self.endpoint = endpoint
        self.layout = layout
        self.incoming: dict[int, Incoming] = {}
        self.by_request: dict[str, int] = {}
        self.quarantine: dict[int, Quarantined] = {}
        self.unsafe = self.engine.config.disaggregation_unsafe_skip_abort_handshake

    def add(self, req: Request, target: PDTarget) -> None:
        """Hold `req` (already in the engine) until its KV lands; InvalidRequest for a room in use."""
        if target.room in self.incoming or target.room in self.quarantine:
            raise InvalidRequest(f"bootstrap_room {target.room} is already in use",
                                 param="bootstrap_room")
        self.engine.scheduler.waiting.remove(req)
        inc = Incoming(req, target)
        fired = self.worker.fire("pd.decode.prealloc")
        if fired is not None and fired.action == "delay":
            inc.due_s = self.worker.clock() + fired.delay_s
        elif fired is not None:
            inc.hang_gen = self.worker.fault_generation
        self.incoming[target.room] = inc
        self.by_request[req.request_id] = target.room

    def handle(self, msg) -> None:
        if isinstance(msg, KVWrite):
            self._write(msg)
        elif isinstance(msg, KVDone):
            inc = self.incoming.get(msg.room)
            if inc is not None and inc.expect_s is not None:
                self._land(inc, msg)
        elif isinstance(msg, SafeToFree):
            self._release(msg.room)
        elif isinstance(msg, PrefillFailed):
            inc = self.incoming.get(msg.room)
            if inc is not None:   # the prefill side has nothing in flight: free at once
                self._end(inc, f"prefill failed: {msg.message}", quarantine=False)
            self._release(msg.room)

    def _write(self, msg: KVWrite) -> None:
        c = self.worker.pd_stats.counters
        inc = self.incoming.get(msg.room)
        if inc is not None and inc.expect_s is not None:
            owned = set(inc.req.page_ids)
            if not all(p in owned for p in msg.page_ids):
                self._end(inc, f"write {msg.write_id} named pages room {msg.room} does not own",
                          quarantine=True)
                return
            self.engine.runner.import_kv(msg.page_ids, msg.data, False)
            inc.landed.add(msg.write_id)
            c["transfer_bytes"] += len(msg.data)
        elif msg.room in self.quarantine:
            self.engine.runner.import_kv(msg.page_ids, msg.data, False)   # absorbed: still its pages
        elif self.unsafe:
            self.engine.runner.import_kv(msg.page_ids, msg.data, True)
            c["late_writes_landed"] += 1
        else:
            c["late_writes_refused"] += 1

    def poll(self) -> None:
        now, cfg = self.worker.clock(), self.engine.config
        for inc in list(self.incoming.values()):
            if inc.expect_s is not None and now - inc.expect_s > cfg.disaggregation_transfer_timeout:
                self._end(inc, f"KV transfer timed out after {cfg.disaggregation_transfer_timeout:g} s "
                               f"(room {inc.target.room})", quarantine=True)
        limit = cfg.disaggregation_transfer_timeout * QUARANTINE_TIMEOUT_FACTOR
        for q in [q for q in self.quarantine.values() if now - q.since_s > limit]:
            logger.warning("room %d: no answer from the prefill side in %.0f s; freeing its %d "
                           "pages (later writes for it are refused)", q.room, limit, len(q.page_ids))
            self._release(q.room)
        self._preallocate(now)

    def _preallocate(self, now: float) -> None:
        eng, kv = self.engine, self.engine.kv
        gen = self.worker.fault_generation
        for inc in list(self.incoming.values()):
            if inc.expect_s is not None:
                continue
            if (inc.due_s is not None and inc.due_s > now) or (inc.hang_gen == gen):
                continue
            num_waiting = sum(i.expect_s is not None for i in self.incoming.values())
            if len(eng.scheduler.running) + num_waiting >= eng.config.max_running_requests:
                return
            req = inc.req
            need = kv.pages_for(len(req.prompt_ids))
            if need + len(eng.scheduler.running) > kv.num_available_pages \
                    or not kv.allocate(req, len(req.prompt_ids)):
                return   # arrival order: a large request is not starved
            req.status = Status.WAITING_FOR_KV
            inc.expect_s = now
            self.worker.pd_stats.queue_time.observe(now - req.arrival_s)
            try:
                self.endpoint.send(inc.target.address, Expect(
                    inc.target.room, list(req.page_ids), len(req.prompt_ids),
                    prompt_crc(req.prompt_ids), req.seed, self.layout))
            except TransportError as exc:   # nothing was asked: no write can come
                self._end(inc, f"cannot reach the prefill worker at {inc.target.address}: {exc}",
                          quarantine=False)

    def _land(self, inc: Incoming, done: KVDone) -> None:
        if inc.landed != set(range(done.num_writes)):
            self._end(inc, f"KV incomplete: {len(inc.landed)} of {done.num_writes} writes landed",
                      quarantine=False)   # the notice comes after every write: none in flight
            return
        eng, req = self.engine, inc.req
        del self.incoming[inc.target.room]
        del self.by_request[req.request_id]
        now = self.worker.clock()
        self.worker.pd_stats.transfer_latency.observe(now - inc.expect_s)
        self.worker.pd_stats.counters["transfers_succeeded"] += 1
        req.num_computed_tokens = len(req.prompt_ids)
        req.num_cached_tokens = done.num_cached_tokens
        req.queue_time_s = now - req.arrival_s
        req.prompt_logprobs = done.prompt_logprobs
        req.status = Status.RUNNING
        eng.scheduler.running.append(req)
        self.worker.land(req, done.first_token)

    def abort(self, request_id: str) -> bool:
        """End a request whose KV is not in (pages quarantined); False if it is not one."""
        room = self.by_request.get(request_id)
        if room is None:
            return False
        self._end(self.incoming[room], None, quarantine=True)
        return True

    def _end(self, inc: Incoming, error: str | None, quarantine: bool) -> None:
        """error None: an abort. `quarantine`: a write may still target its pages."""
        eng, req, room = self.engine, inc.req, inc.target.room
        del self.incoming[room]
        del self.by_request[req.request_id]
        self.worker.pd_stats.counters["transfers_aborted" if error is None else "transfers_failed"] += 1
        pages, req.page_ids = req.page_ids, []
        if pages and quarantine and not self.unsafe:
            self.quarantine[room] = Quarantined(room, pages, self.worker.clock())
        else:
            eng.kv.pool.free(pages)
        if quarantine:
            try:
                self.endpoint.send(inc.target.address, AbortRoom(room, error or "aborted"))
            except TransportError as exc:   # the quarantine timeout frees the pages
                logger.warning("room %d: cannot tell the prefill worker of the abort: %s", room, exc)
        self.worker.end_request(req, error)

    def _release(self, room: int) -> None:
        q = self.quarantine.pop(room, None)
        if q is not None:
            self.engine.kv.pool.free(q.page_ids)

    def page_owners(self) -> list:
        """Holders of pages outside the scheduler (KVManager.check_invariants)."""
        return [i.req for i in self.incoming.values()] + list(self.quarantine.values())

    def gauges(self) -> dict[str, int]:
        return {"num_bootstrapping": sum(i.expect_s is None for i in self.incoming.values()),
                "num_waiting_for_kv": sum(i.expect_s is not None for i in self.incoming.values()),
                "num_quarantined_pages": sum(len(q.page_ids) for q in self.quarantine.values())}

    def num_unscheduled(self) -> int:
        return len(self.incoming)

    def is_busy(self) -> bool:
        return bool(self.incoming or self.quarantine)
