"""Prefill side of PD: the bootstrap service's rooms, their write ledger, and the writer's half of the abort handshake.

    BOOTSTRAP --Expect--+
                        +--> [STARTING] --> PREFILLING --finish--> SENT --drained--> CLOSED (tombstone)
    EXPECTED --request--+    (fault hold)   page-chunk writes      KVDone queued
    any state --AbortRoom / failure--> closing --in-flight drained--> SafeToFree / PrefillFailed, CLOSED"""
from __future__ import annotations

import logging
from collections import deque

import zmq

from radixserve.disagg.api import SideHost
from radixserve.disagg.bootstrap import BootstrapHandler
from radixserve.disagg.protocol import (AbortRoom, Expect, KVDone, KVLayout, KVWrite, PDTarget,
                                        PrefillFailed, SafeToFree)
from radixserve.disagg.rooms import HeldWrite, Room, RoomState, held_over
from radixserve.engine.request import Request, Status
from radixserve.errors import InvalidRequest, KVTransferFailed
from radixserve.outputs import TokenLogprob

logger = logging.getLogger(__name__)

TOMBSTONE_TTL_FACTOR = 10    # closed rooms are remembered (and refused) this many transfer timeouts


class PrefillSide(BootstrapHandler):
    def __init__(self, worker: SideHost, endpoint, layout: KVLayout):
        self.worker = worker
        self.engine = worker.engine
        self.endpoint = endpoint
        self.layout = layout
        self.rooms: dict[int, Room] = {}
        self.open: dict[int, Room] = {}
        self.tombstones: deque[tuple[float, int]] = deque()   # (closed at, room), oldest first
        self.by_request: dict[str, Room] = {}
        self.held: list[HeldWrite] = []
        self.held_expects: list[tuple[float, bytes, Expect]] = []

    def add(self, req: Request, target: PDTarget) -> None:
        """Engine request `req` for `target.room`; InvalidRequest: room in use; KVTransferFailed: decode ended it."""
        room = self.rooms.get(target.room)
        if room is not None and room.state is RoomState.CLOSED:
            raise KVTransferFailed(f"room {target.room} already ended on the prefill worker "
                                   f"({room.closing or 'closed'})")
        if room is not None and room.req is not None:
            raise InvalidRequest(f"bootstrap_room {target.room} is already in use",
                                 param="bootstrap_room")
        self.engine.scheduler.waiting.remove(req)
        req.max_tokens = min(req.max_tokens, 1)   # prefill samples the first token only
        if room is not None and room.state is RoomState.EXPECTED:
            problem = self._prompt_mismatch(req, room.expect)
            if problem is not None:
                self.worker.pd_stats.counters["bootstrap_failures"] += 1
                self._fail_room(room, problem)
                raise KVTransferFailed(problem)
        if room is None:
            room = self._new_room(target.room, RoomState.BOOTSTRAP)
        room.req = req
        self.by_request[req.request_id] = room
        if room.state is RoomState.EXPECTED:
            req.seed = room.expect.seed
            self._ready(room)

    def _ready(self, room: Room) -> None:
        room.ready_s = self.worker.clock()
        fired = self.worker.fire("pd.prefill.start")
        if fired is None:
            self._start(room)
            return
        room.state = RoomState.STARTING
        if fired.action == "delay":
            room.start_due_s = room.ready_s + fired.delay_s
        else:
            room.start_hang_gen = self.worker.fault_generation

    def _start(self, room: Room) -> None:
        room.state = RoomState.PREFILLING
        room.req.status = Status.WAITING
        self.engine.scheduler.add(room.req)

    def after_step(self) -> None:
        """Send the full pages each prefilling request completed (the partial last one goes at finish)."""
        page_size = self.engine.page_size
        for room in list(self.by_request.values()):
            req = room.req
            if room.state is RoomState.PREFILLING and req.status is Status.RUNNING:
                full = min(self.engine.kv.num_settled_tokens(req), len(req.prompt_ids)) // page_size
                if full > room.num_pages_sent:
                    self._write_pages(room, full)

    def on_finish(self, req: Request, token: TokenLogprob | None) -> None:
        """`req` sampled its first token (None: max_tokens 0): send its other pages, queue KVDone."""
        room = self.by_request.pop(req.request_id)
        room.req = None
        self._write_pages(room, self.engine.kv.pages_for(len(req.prompt_ids)), req)
        if room.closing is not None:
            self._try_close(room)
            return
        queue_s = req.arrival_s + (req.queue_time_s or 0.0) - room.ready_s
        self.worker.pd_stats.queue_time.observe(max(queue_s, 0.0))
        room.done = KVDone(room.room, room.num_writes, token, req.prompt_logprobs,
                           req.num_cached_tokens)
        room.state = RoomState.SENT
        fired = self.worker.fire("pd.transfer.done")
        if fired is not None and fired.action == "fail":
            self._fail_room(room, "the KV completion notice failed (injected fault pd.transfer.done)")
            return
        if fired is not None and fired.action == "delay":
            room.done_due_s = self.worker.clock() + fired.delay_s
        elif fired is not None:
            room.done_hang_gen = self.worker.fault_generation
        self._try_close(room)

    def _write_pages(self, room: Room, end: int, req: Request | None = None) -> None:
        req = req or room.req
        chunk = self.engine.config.disaggregation_chunk_pages
        while room.num_pages_sent < end:
            start, stop = room.num_pages_sent, min(room.num_pages_sent + chunk, end)
            room.num_pages_sent = stop
            if room.closing is not None:   # invariant: a closing room starts no write
                self.worker.pd_stats.counters["late_writes_refused"] += 1
                continue
            data = self.engine.runner.export_kv(req.page_ids[start:stop])
            msg = KVWrite(room.room, room.num_writes, room.dest_page_ids[start:stop], data)
            room.num_writes += 1
            self.worker.pd_stats.counters["transfer_bytes"] += len(data)
            self._start_write(room, msg)

    def _start_write(self, room: Room, msg: KVWrite) -> None:
        fired = self.worker.fire("pd.transfer.write")
        action = fired.action if fired is not None else None
        if action == "fail":
            self._fail_room(room, f"KV transfer write {msg.write_id} failed "
                                  "(injected fault pd.transfer.write)")
            return
        if action in (None, "duplicate"):
            self._send(room.peer, msg)
            if action == "duplicate":
                self._send(room.peer, msg)
            return
        room.num_in_flight += 1
        if action == "delay":
            self.held.append(HeldWrite(room, msg, self.worker.clock() + fired.delay_s))
        elif action == "hang":
            self.held.append(HeldWrite(room, msg, None, hang_gen=self.worker.fault_generation))
        else:
            self.held.append(HeldWrite(room, msg, None, late=True))

    def poll(self) -> None:
        """Deliver due held items, start held rooms, time out rooms whose other leg never came."""
        now, gen = self.worker.clock(), self.worker.fault_generation
        due = [h for h in self.held if h.is_due(now, gen)]
        for h in due:
            self.held.remove(h)
            self._send(h.room.peer, h.msg)
            h.room.num_in_flight -= 1
            self._try_close(h.room)
        expects = [e for e in self.held_expects if e[0] <= now]
        for e in expects:
            self.held_expects.remove(e)
            self._guarded_expect(e[1], e[2])
        timeout = self.engine.config.disaggregation_transfer_timeout
        for room in list(self.open.values()):
            if room.state is RoomState.STARTING and held_over(room.start_due_s,
                                                              room.start_hang_gen, now, gen):
                self._start(room)
            elif room.state is RoomState.SENT and room.num_in_flight == 0 and held_over(
                    room.done_due_s, room.done_hang_gen, now, gen):
                room.done_due_s = room.done_hang_gen = None
                self._try_close(room)
            elif room.state in (RoomState.BOOTSTRAP, RoomState.EXPECTED) and room.closing is None \
                    and now - room.created_s > timeout:
                other = "decode worker" if room.state is RoomState.BOOTSTRAP else "prefill request"
                self._fail_room(room, f"no {other} came for room {room.room} within {timeout:g} s")
        while self.tombstones and now - self.tombstones[0][0] > TOMBSTONE_TTL_FACTOR * timeout:
            _, room_id = self.tombstones.popleft()
            room = self.rooms.get(room_id)
            if room is not None and room.state is RoomState.CLOSED:
                del self.rooms[room_id]

    def _abort_room(self, peer: bytes, msg: AbortRoom) -> None:
        room = self.rooms.get(msg.room)
        if room is None:   # nothing ever started for it: tombstone, answer at once
            room = self._new_room(msg.room, RoomState.EXPECTED)
            room.peer, room.closing = peer, "abort"
            self._close(room)
            self._send(peer, SafeToFree(msg.room))
            return
        room.peer = room.peer or peer
        if room.state is RoomState.CLOSED:
            self._send(peer, SafeToFree(msg.room))
            return
        if room.closing is None:
            room.closing = "abort"
            self.worker.pd_stats.counters["transfers_aborted"] += 1
        self._end_request(room, f"aborted by the decode worker: {msg.reason}")
        self._try_close(room)

    def abort(self, request_id: str) -> bool:
        """Fail the room of a prefill leg that ended early; False if it is not a PD request."""
        room = self.by_request.get(request_id)
        if room is None:
            return False
        self._fail_room(room, "the prefill request was aborted", "transfers_aborted")
        return True

    def _fail_room(self, room: Room, message: str, outcome: str = "transfers_failed") -> None:
        """Decode gets PrefillFailed(`message`) once nothing is in flight; `outcome`: the counter."""
        if room.closing is None:
            room.closing = message
            self.worker.pd_stats.counters[outcome] += 1
        self._end_request(room, message)
        self._try_close(room)

    def _end_request(self, room: Room, message: str) -> None:
        req = room.req
        if req is None:
            return
        room.req = None
        self.by_request.pop(req.request_id, None)
        if req.request_id in self.engine.requests:
            self.worker.end_request(req, message)

    def _try_close(self, room: Room) -> None:
        """Invariant: the final message goes out only at num_in_flight == 0 (after every write)."""
        if room.num_in_flight > 0 or room.state is RoomState.CLOSED:
            return
        if room.closing is None:
            if room.done is None or room.done_due_s is not None or room.done_hang_gen is not None:
                return
            self._send(room.peer, room.done)
            self.worker.pd_stats.counters["transfers_succeeded"] += 1
        else:
            self._send(room.peer, SafeToFree(room.room) if room.closing == "abort"
                       else PrefillFailed(room.room, room.closing))
        self._close(room)

    def _new_room(self, room_id: int, state: RoomState) -> Room:
        room = self.rooms[room_id] = self.open[room_id] = Room(room_id, self.worker.clock(), state)
        return room

    def _close(self, room: Room) -> None:
        room.state, room.done = RoomState.CLOSED, None
        self.open.pop(room.room, None)
        self.tombstones.append((self.worker.clock(), room.room))

    def _send(self, peer: bytes | None, msg) -> None:
        if peer is None:
            return
        try:
            self.endpoint.send(peer, msg)
        except zmq.ZMQError as exc:
            logger.warning("cannot reach decode peer for room %d: %s", msg.room, exc)

    def gauges(self) -> dict[str, int]:
        live = list(self.open.values())
        return {"num_bootstrapping": sum(r.state in (RoomState.BOOTSTRAP, RoomState.EXPECTED)
                                         for r in live),
                "num_rooms": len(live), "num_writes_in_flight": sum(r.num_in_flight for r in live)}

    def num_unscheduled(self) -> int:
        return sum(r.state in (RoomState.BOOTSTRAP, RoomState.STARTING)
                   for r in self.by_request.values())

    def is_busy(self) -> bool:
        return bool(self.held or self.held_expects
                    or bool(self.open))
