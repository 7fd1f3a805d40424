"""PrefillSide's bootstrap handler (a mixin): Expect and AbortRoom; a failure in it fails one request, never the service."""
from __future__ import annotations

import logging

from radixserve.disagg.protocol import AbortRoom, Expect, PrefillFailed, prompt_crc
from radixserve.disagg.rooms import RoomState
from radixserve.engine.request import Request

logger = logging.getLogger(__name__)


class BootstrapHandler:
    def handle(self, peer: bytes, msg) -> None:
        if isinstance(msg, Expect):
            fired = self.worker.fire("pd.bootstrap")
            if fired is not None and fired.action == "delay":
                self.held_expects.append((self.worker.clock() + fired.delay_s, peer, msg))
            else:
                self._guarded_expect(peer, msg, injected=fired is not None)
        elif isinstance(msg, AbortRoom):
            self._abort_room(peer, msg)

    def _guarded_expect(self, peer: bytes, msg: Expect, injected: bool = False) -> None:
        try:
            if injected:
                raise RuntimeError("injected fault pd.bootstrap")
            self._expect(peer, msg)
        except Exception as exc:
            logger.exception("bootstrap handler failed for room %d", msg.room)
            self.worker.pd_stats.counters["bootstrap_failures"] += 1
            self._refuse(peer, msg.room, f"bootstrap handler failed: {type(exc).__name__}: {exc}")

    def _expect(self, peer: bytes, msg: Expect) -> None:
        room = self.rooms.get(msg.room)
        problem = self.layout.mismatch(msg.layout)
        if problem is None and room is not None and room.state is RoomState.CLOSED:
            problem = f"room {msg.room} already ended on the prefill worker ({room.closing or 'closed'})"
        elif problem is None and room is not None and room.peer is not None:
            problem = f"room {msg.room} was already asked for by a decode worker"
        elif problem is None and room is not None and room.req is not None:
            problem = self._prompt_mismatch(room.req, msg)
        if problem is not None:
            self.worker.pd_stats.counters["bootstrap_failures"] += 1
            self._refuse(peer, msg.room, problem)
            return
        if room is None:
            room = self._new_room(msg.room, RoomState.EXPECTED)
        room.peer, room.dest_page_ids = peer, list(msg.page_ids)
        if room.req is not None:
            room.req.seed = msg.seed
            self._ready(room)
        else:
            room.expect = msg

    def _prompt_mismatch(self, req: Request, msg: Expect) -> str | None:
        """Why the decode worker's Expect does not fit this prefill request (None: it fits)."""
        need = self.engine.kv.pages_for(len(req.prompt_ids))
        if (len(msg.page_ids) < need or msg.num_prompt_tokens != len(req.prompt_ids)
                or msg.prompt_crc != prompt_crc(req.prompt_ids)):
            return (f"the legs disagree on the prompt: decode has {msg.num_prompt_tokens} tokens "
                    f"(crc {msg.prompt_crc:08x}) in {len(msg.page_ids)} pages, prefill "
                    f"{len(req.prompt_ids)} tokens (crc {prompt_crc(req.prompt_ids):08x}) in "
                    f"{need} pages")
        return None

    def _refuse(self, peer: bytes, room_id: int, message: str) -> None:
        """Its request (if here) ends with `message`; decode gets PrefillFailed."""
        logger.warning("room %d refused: %s", room_id, message)
        room = self.rooms.get(room_id)
        if room is None or room.state is RoomState.CLOSED:
            self._send(peer, PrefillFailed(room_id, message))
            return
        if room.peer is None:
            room.peer = peer
        self._fail_room(room, message)
