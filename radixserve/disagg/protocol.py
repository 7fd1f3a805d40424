"""PD wire messages (msgpack), sent in order on one stream per (decode, prefill) pair (docs/disaggregation.md).

decode -> prefill: Expect (pages preallocated, fill them), AbortRoom (decode gave up).
prefill -> decode: KVWrite (one page chunk), KVDone (all writes sent, first token), SafeToFree
(answers AbortRoom: no write of the room in flight or to come), PrefillFailed (implies SafeToFree)."""
from __future__ import annotations

import array
import zlib

import msgspec

from radixserve.engine.messages import PDTarget
from radixserve.outputs import TokenLogprob


class KVLayout(msgspec.Struct, frozen=True):
    """What must match for pages to mean the same on both sides, and the worker's parallel layout (its --tp/cp/pp-size,
    --enable-layer-split), checked per request (`mismatch`). `layer_ids`: the model layer of each exported layer."""

    page_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: str              # architecture, sizes and a weight fingerprint
    layer_ids: tuple[int, ...]
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    layer_split: bool = False

    def describe(self) -> str:
        return (f"tp={self.tp_size} cp={self.cp_size} pp={self.pp_size}"
                f"{' with layer split' if self.layer_split else ''}")

    def mismatch(self, decode: KVLayout) -> str | None:
        """Why this prefill worker cannot fill `decode`'s pages (None: it can). Built: a prefill worker of one rank, TP
        or CP (rank 0 sends every layer's KV and head) -> a decode worker of one rank or TP (runner/tp.py import_kv)."""
        if not (self.pp_size == 1 and decode.cp_size == decode.pp_size == 1 and not decode.layer_split):
            return (f"PD layout pair not built: prefill worker {self.describe()} -> decode worker "
                    f"{decode.describe()} (built: prefill pp=1 -> decode cp=1 pp=1)")
        for side, layout in (("prefill", self), ("decode", decode)):
            if tuple(layout.layer_ids) != tuple(range(layout.num_layers)):
                return (f"KV layer ids on {side} are {list(layout.layer_ids)}, not layers 0..{layout.num_layers - 1} "
                        f"in order: pages pair by layer id")
        for name in ("page_size", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "model"):
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
    prompt_crc: int
    seed: int                     # the first token is sampled with decode's seed
    layout: KVLayout


class AbortRoom(msgspec.Struct, frozen=True, tag=True):
    room: int
    reason: str


class KVWrite(msgspec.Struct, frozen=True, tag=True):
    room: int
    write_id: int                 # 0, 1, ... per room
    page_ids: list[int]
    data: bytes


class KVDone(msgspec.Struct, frozen=True, tag=True):
    room: int
    num_writes: int               # writes sent before this notice
    first_token: TokenLogprob | None   # None when max_tokens == 0
    prompt_logprobs: list[TokenLogprob] | None
    num_cached_tokens: int


class SafeToFree(msgspec.Struct, frozen=True, tag=True):
    room: int


class PrefillFailed(msgspec.Struct, frozen=True, tag=True):
    room: int
    message: str


__all__ = ["prompt_crc", "KVLayout", "PDTarget", "Expect", "AbortRoom", "KVWrite", "KVDone", "SafeToFree",
           "PrefillFailed", "ToPrefill", "ToDecode"]

ToPrefill = Expect | AbortRoom
ToDecode = KVWrite | KVDone | SafeToFree | PrefillFailed
