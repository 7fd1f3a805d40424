"""A scripted Runner for engine tests: paged 'KV' that stores token ids, deterministic tokens.

The fake KV holds (token, position) per slot. Every step writes the input tokens into the
slots the page table names and reads the whole context back through the page table, so a
wrong page table, a page freed too early, or a page shared by mistake changes the output or
trips an assertion. The next token is a hash of the context: any corruption shows.

`copy_period` > 0 makes the fake model copy: the next token is the one `copy_period` positions
back, except where the context hash says otherwise (one position in `copy_noise`), so n-gram
drafts are mostly but not always right. Draft sequences (speculative decoding) are verified
greedily against that same next-token function, position by position; asked to propose
(model-draft speculation), the fake returns its own continuation with every third token wrong.
"""
from __future__ import annotations

import hashlib

import msgspec

from radixserve.engine.runner_api import ScheduledSeq, SeqResult
from radixserve.outputs import TokenLogprob


def reference_next_token(context: list[int], vocab_size: int, eos: int | None = None,
                         eos_every: int = 0, copy_period: int = 0, copy_noise: int = 7) -> int:
    """The token the fake model emits after `context` (what a correct engine must return)."""
    digest = hashlib.blake2b(repr(context).encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    if eos is not None and eos_every and value % eos_every == 0:
        return eos
    if copy_period and len(context) >= copy_period and value % copy_noise:
        return context[-copy_period]
    token = value % vocab_size
    return token if token != eos else (token + 1) % vocab_size


class FakeRunner:
    """Runner protocol implementation with no tensors (see module docstring)."""

    def __init__(self, num_pages: int = 64, page_size: int = 4, vocab_size: int = 1000,
                 max_context_len: int = 4096, eos: int | None = None, eos_every: int = 0,
                 copy_period: int = 0):
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
        self.max_context_len = max_context_len
        self.eos, self.eos_every, self.copy_period = eos, eos_every, copy_period
        self.eos_token_ids = frozenset([eos] if eos is not None else [])
        self.slots: list[tuple[int, int] | None] = [None] * (num_pages * page_size)
        self.steps: list[list[ScheduledSeq]] = []

    def info(self) -> dict:
        return {"device": "none (fake runner)"}

    def slot(self, page_ids: list[int], pos: int) -> int:
        return page_ids[pos // self.page_size] * self.page_size + pos % self.page_size

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        self.steps.append(batch)
        seen_pages: dict[int, str] = {}
        results = []
        for seq in batch:
            end = seq.start_pos + len(seq.input_ids)
            assert len(seq.page_ids) * self.page_size >= end, "page table too short"
            for i, tok in enumerate(seq.input_ids):
                pos = seq.start_pos + i
                page = seq.page_ids[pos // self.page_size]
                # Two sequences writing one page in one step would corrupt each other.
                assert seen_pages.setdefault(page, seq.request_id) == seq.request_id, "page written twice"
                self.slots[self.slot(seq.page_ids, pos)] = (tok, pos)
            context = []
            for pos in range(end):
                entry = self.slots[self.slot(seq.page_ids, pos)]
                assert entry is not None and entry[1] == pos, f"stale KV at position {pos}"
                context.append(entry[0])
            token, accepted = None, []
            if seq.sample:
                # Position i of a draft scores the token after context[:end - k + i].
                k = len(seq.draft)
                for i in range(k + 1):
                    token = self._next(context[:end - k + i], seq.min_tokens_left - i, seq.params.stop_token_ids)
                    if i == k or token.token_id != seq.draft[i]:
                        break
                    accepted.append(token)
            prompt_lp = None
            if seq.prompt_logprob_start is not None:
                last = min(end, len(seq.prompt_ids) - 1)
                prompt_lp = [TokenLogprob(seq.prompt_ids[q], -1.0, [])
                             for q in range(seq.start_pos + 1, last + 1)]
            next_draft: tuple[int, ...] = ()
            if seq.propose and token is not None:
                # positions before the new token: the verified prefix (accepted drafts included)
                verified = context[:end - len(seq.draft) + len(accepted)]
                next_draft = self._draft([*verified, token.token_id], seq.propose)
            emitted = [*accepted, token] if token is not None else []
            ids = tuple(t.token_id for t in emitted)
            logprobs = tuple(emitted) if seq.params.wants_logprobs else None
            results.append(SeqResult(seq.request_id, ids, logprobs, prompt_lp, next_draft))
        return results

    def _draft(self, context: list[int], k: int) -> tuple[int, ...]:
        """A model draft (ScheduledSeq.propose): the fake model's own greedy continuation, with
        every third token wrong, so some drafts are rejected."""
        out = []
        for i in range(k):
            tid = reference_next_token(context, self.vocab_size, self.eos, self.eos_every, self.copy_period)
            tid = (tid + 1) % self.vocab_size if i % 3 == 2 else tid
            out.append(tid)
            context = [*context, tid]
        return tuple(out)

    def corrupt_kv(self, page_ids: list[int], mode: str, source_page_ids: list[int] | None,
                   seed: int) -> None:
        """The kv_corrupt fault point: noise puts other tokens in the pages' slots, swap and stale copy
        the source pages' tokens (positions stay right: the fake checks them, real KV cannot)."""
        for n, page in enumerate(page_ids):
            for offset in range(self.page_size):
                slot = page * self.page_size + offset
                if self.slots[slot] is None:
                    continue
                if mode in ("swap", "stale"):
                    src = self.slots[source_page_ids[n] * self.page_size + offset]
                    token = src[0] if src is not None else 0
                else:
                    token = (self.slots[slot][0] * 31 + seed + offset + 1) % self.vocab_size
                self.slots[slot] = (token, self.slots[slot][1])

    # ---- prefill->decode transfer (radixserve/disagg): the fake KV's slots as bytes -----------
    def kv_layout(self) -> dict:
        return {"page_size": self.page_size, "kv_dtype": "fake", "num_layers": 1,
                "num_kv_heads": 1, "head_dim": 1, "model": f"fake vocab={self.vocab_size}",
                "layer_ids": (0,)}

    def export_kv(self, page_ids: list[int]) -> bytes:
        return msgspec.msgpack.encode([self.slots[p * self.page_size + o] for p in page_ids
                                       for o in range(self.page_size)])

    def import_kv(self, page_ids: list[int], data: bytes, foreign: bool) -> None:
        entries = msgspec.msgpack.decode(data)
        assert len(entries) == len(page_ids) * self.page_size, "payload does not fit the pages"
        for i, entry in enumerate(entries):
            slot = page_ids[i // self.page_size] * self.page_size + i % self.page_size
            self.slots[slot] = tuple(entry) if entry is not None else None

    def _next(self, context: list[int], min_tokens_left: int, stop_ids) -> TokenLogprob:
        tid = reference_next_token(context, self.vocab_size, self.eos, self.eos_every, self.copy_period)
        if min_tokens_left > 0 and tid in self.eos_token_ids | set(stop_ids):
            tid = (tid + 1) % self.vocab_size
        return TokenLogprob(tid, -0.5, [(tid, -0.5)])


class FakeHandle:
    """LoadHandle of FakeHostKV (engine/hicache.py's protocol)."""

    def __init__(self, num_pages: int):
        import threading
        self.done = threading.Event()
        self.failed = False
        self.seconds = 0.0
        self.num_bytes = num_pages

    def wait(self) -> None:
        assert self.done.is_set(), "a fake load was waited on before it completed"


class FakeHostKV:
    """The host tier's KVTierIO over FakeRunner's slots. A backup copies (token, position)
    entries into host slots; a load copies them back at once, or, for the next `fail_next`
    loads, writes wrong tokens (what a half-copied real page holds) and reports failure. With
    `deferred`, loads wait in `pending` until `complete()` (to test pinning; the fake runner
    does not wait for them, so do not step the engine meanwhile)."""

    def __init__(self, runner: FakeRunner, num_pages: int):
        self.runner, self.num_pages, self.page_bytes = runner, num_pages, 1
        self.slots: list[tuple[int, int] | None] = [None] * (num_pages * runner.page_size)
        self.fail_next = 0
        self.deferred = False
        self.pending: list[tuple[FakeHandle, list[int], list[int]]] = []
        self.num_backups = self.num_loads = 0

    def _copy(self, src: list, dst: list, src_ids: list[int], dst_ids: list[int], garble: bool = False) -> None:
        p = self.runner.page_size
        for s, d in zip(src_ids, dst_ids):
            for o in range(p):
                entry = src[s * p + o]
                if garble and entry is not None:
                    entry = ((entry[0] + 1) % self.runner.vocab_size, entry[1])
                dst[d * p + o] = entry

    def backup(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.num_backups += 1
        self._copy(self.runner.slots, self.slots, device_ids, host_ids)

    def load(self, host_ids: list[int], device_ids: list[int]) -> FakeHandle:
        self.num_loads += 1
        handle = FakeHandle(len(host_ids))
        self.pending.append((handle, list(host_ids), list(device_ids)))
        if not self.deferred:
            self.complete()
        return handle

    def complete(self) -> None:
        for handle, host_ids, device_ids in self.pending:
            handle.failed = self.fail_next > 0
            self.fail_next = max(self.fail_next - 1, 0)
            self._copy(self.slots, self.runner.slots, host_ids, device_ids, garble=handle.failed)
            handle.done.set()
        self.pending = []


class FakeFetch:
    def __init__(self, n: int):
        import threading
        self.done, self.num_ok, self.seconds = threading.Event(), 0, 0.0


class FakeDiskKV:
    """The disk tier's DiskIO over FakeHostKV's slots: a dict of page name -> slot entries,
    shared between engines to play a restart. Fetches land at once, or, with `deferred`, on
    `complete()`; `limit` caps the pages a fetch lands (the hicache.l3.get fault's cut)."""

    def __init__(self, host: FakeHostKV, store: dict | None = None):
        self.host, self.store = host, store if store is not None else {}
        self.index = set(self.store)
        self.deferred, self.limit = False, None
        self.pending: list = []
        self.num_fetches = 0

    def has(self, name: str) -> bool:
        return name in self.store

    def write(self, host_ids: list[int], names: list[str]) -> None:
        p = self.host.runner.page_size
        for h, name in zip(host_ids, names):
            self.store[name] = list(self.host.slots[h * p:(h + 1) * p])
            self.index.add(name)

    def fetch(self, names: list[str], host_ids: list[int]) -> FakeFetch:
        self.num_fetches += 1
        handle = FakeFetch(len(names))
        self.pending.append((handle, names, host_ids))
        if not self.deferred:
            self.complete()
        return handle

    def complete(self) -> None:
        p = self.host.runner.page_size
        for handle, names, host_ids in self.pending:
            n = len(names) if self.limit is None else min(self.limit, len(names))
            for name, h in zip(names[:n], host_ids):
                self.host.slots[h * p:(h + 1) * p] = self.store[name]
            handle.num_ok = n
            handle.done.set()
        self.pending = []
