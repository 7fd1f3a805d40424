"""The `kv_corrupt` fault: overwrite part of a running request's KV with noise, another running request's KV, or a free
page's stale KV (what a finished request left there; a lost write) (docs/anomaly_guard.md)."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.engine.request import Request
from radixserve.errors import InvalidRequest

MODES = ("noise", "swap", "stale")


@dataclass(frozen=True, slots=True)
class Corruption:
    """`page_ids` get `mode`; for swap and stale, `source_page_ids` (same length) are copied over them."""

    request_id: str
    page_ids: list[int]
    mode: str
    source_page_ids: list[int] | None
    seed: int


@dataclass(slots=True)
class KVCorruptFault:
    mode: str
    fraction: float
    after_tokens: int
    num_left: int
    ends_s: float | None
    rng: random.Random = field(default_factory=random.Random)
    hit: list[tuple[str, int]] = field(default_factory=list)   # (request id, its output tokens then)

    @classmethod
    def armed(cls, mode: str, fraction: float, after_tokens: int, count: int,
              duration_s: float | None, seed: int | None) -> KVCorruptFault:
        """Raises InvalidRequest for a bad mode, fraction, after_tokens or count."""
        if mode not in MODES:
            raise InvalidRequest(f"kv_corrupt mode must be one of {MODES}, got {mode!r}",
                                 param="mode")
        if not 0 < fraction <= 1 or after_tokens < 0 or count < 1:
            raise InvalidRequest("kv_corrupt needs 0 < fraction <= 1, after_tokens >= 0 and "
                                 "count >= 1", param="fraction")
        ends_s = None if duration_s is None else time.monotonic() + duration_s
        return cls(mode, fraction, after_tokens, count, ends_s, random.Random(seed))

    def next(self, running: list[Request], page_size: int, now_s: float,
             free_page_ids: Sequence[int] = ()) -> Corruption | None:
        """The corruption due now among `running` (None: not yet, spent or expired); marks it hit. `free_page_ids`
        (stale only): PagePool.free_ids(), whose tail are the pages freed last; stale copies the last ones."""
        if self.is_spent or (self.ends_s is not None and now_s >= self.ends_s):
            self.num_left = 0
            return None
        done = {rid for rid, _ in self.hit}
        victim = next((r for r in running if r.request_id not in done
                       and len(r.output_ids) >= self.after_tokens
                       and _computed_pages(r, page_size)), None)
        if victim is None:
            return None
        pages = _computed_pages(victim, page_size)
        num = min(max(1, round(self.fraction * len(pages))), len(pages))
        chosen = sorted(self.rng.sample(pages, num))
        source = None
        if self.mode == "swap":
            others = [p for r in running if r is not victim
                      for p in _computed_pages(r, page_size) if p not in pages]
            if not others:
                return None       # nothing to cross with yet
            source = [others[i % len(others)] for i in range(num)]
        elif self.mode == "stale":
            if len(free_page_ids) < num:
                return None
            source = list(free_page_ids[-num:])
        self.hit.append((victim.request_id, len(victim.output_ids)))
        self.num_left -= 1
        return Corruption(victim.request_id, chosen, self.mode, source, self.rng.getrandbits(31))

    @property
    def is_spent(self) -> bool:
        return self.num_left <= 0


def _computed_pages(req: Request, page_size: int) -> list[int]:
    num = -(-req.num_computed_tokens // page_size)
    return list(dict.fromkeys(req.page_ids[:num]))
