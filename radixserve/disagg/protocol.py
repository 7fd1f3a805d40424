"""Wire messages between a decode worker's engine and a prefill worker's bootstrap service (msgpack via msgspec).

One ordered stream per (decode, prefill) pair (transport.py), so a message sent after another
also lands after it. That order is what the abort handshake relies on (docs/disaggregation.md):

    decode -> prefill   Expect(room, page_ids, layout, ...)   pages are preallocated; fill them
                        AbortRoom(room)                        decode gave up on the room
    prefill -> decode   KVWrite(room, write_id, page_ids, data) one chunk of pages (a "write")
                        KVDone(room, first_token, ...)         all writes sent; the first token
                        SafeToFree(room)                       answer to AbortRoom: no write of
                                                               the room is in flight, none will start
                        PrefillFailed(room, message)           the prefill side gave up; implies
                                                               SafeToFree
"""
from __future__ import annotations

import array
import zlib

import msgspec

from radixserve.engine.messages import PDTarget
from radixserve.outputs import TokenLogprob


class KVLayout(msgspec.Struct, frozen=True):
    """What must match for KV pages to mean the same thing on both sides (checked per request,
    so a mismatch fails that request and never poisons the pair)."""

    page_size: int          # tokens per page
    kv_dtype: str           # stored dtype ("float32", "bfloat16", "float8_e4m3fn", ...)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: str              # model identity: architecture, sizes and a weight fingerprint

    def mismatch(self, decode: KVLayout) -> str | None:
        """None when `decode` (the other side's layout) matches this prefill layout, else a
        message naming the first differing field with both values."""
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(decode, name)
            if mine != theirs:
                return (f"KV layout mismatch between prefill and decode workers: {name} is "
                        f"{mine!r} on prefill but {theirs!r} on decode")
        return None


def prompt_crc(prompt_ids: list[int]) -> int:
    """CRC-32 of a prompt's token ids: both legs must prefill and decode the same tokens."""
    return zlib.crc32(array.array("q", prompt_ids).tobytes())


class Expect(msgspec.Struct, frozen=True, tag=True):
    room: int
    page_ids: list[int]           # destination pages, covering the prompt (page order)
    num_prompt_tokens: int
    prompt_crc: int               # prompt_crc of the decode request's prompt
    seed: int                     # the decode request's sampling seed (the first token uses it)
    layout: KVLayout


class AbortRoom(msgspec.Struct, frozen=True, tag=True):
    room: int
    reason: str


class KVWrite(msgspec.Struct, frozen=True, tag=True):
    room: int
    write_id: int                 # 0, 1, ... per room
    page_ids: list[int]           # destination pages this write fills (decode's ids)
    data: bytes                   # runner-defined payload of those pages (Runner.export_kv)


class KVDone(msgspec.Struct, frozen=True, tag=True):
    room: int
    num_writes: int               # writes sent for the room before this notice
    first_token: TokenLogprob | None   # None when max_tokens == 0
    prompt_logprobs: list[TokenLogprob] | None
    num_cached_tokens: int        # the prefill side's prefix-cache hit


class SafeToFree(msgspec.Struct, frozen=True, tag=True):
    room: int


class PrefillFailed(msgspec.Struct, frozen=True, tag=True):
    room: int
    message: str


__all__ = ["prompt_crc", "KVLayout", "PDTarget", "Expect", "AbortRoom", "KVWrite", "KVDone", "SafeToFree",
           "PrefillFailed", "ToPrefill", "ToDecode"]   # PDTarget: engine/messages.py's, re-exported

ToPrefill = Expect | AbortRoom
ToDecode = KVWrite | KVDone | SafeToFree | PrefillFailed
