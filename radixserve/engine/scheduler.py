"""Scheduler: token-budget continuous batching with chunked prefill, policies and preemption (as vLLM v1).

Each step hands out `chunked_prefill_size` tokens: running requests first (a decode token plus any draft, or
a prefill chunk), then waiting ones in policy order. Out of pages: evict radix leaves, then preempt the newest."""
from __future__ import annotations

import time
from collections import deque

from radixserve.engine.kv_manager import KVManager
from radixserve.engine.request import Request, Status
from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine.speculative import ModelDraftProposer, NgramProposer
from radixserve.engine_config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, max_request_tokens: int, break_even_tokens: float = 16.0):
        """`break_even_tokens`: the speculative batch gate's R (speculative.resolve_break_even)."""
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.fetching: list[Request] = []
        self.num_preemptions = 0
        k = config.spec_max_draft
        # Deterministic inference: drafts depend on the request alone (no batch gate, no shared table).
        alone = config.enable_deterministic_inference
        gate = 0.0 if alone else break_even_tokens
        self.proposer: NgramProposer | ModelDraftProposer | None = (
            NgramProposer(k, shared_entries=0 if alone else 1 << 16, break_even_tokens=gate)
            if config.speculative_algorithm == "ngram"
            else ModelDraftProposer(k, gate) if config.speculative_algorithm == "draft" or config.is_eagle
            else None)
        self.max_request_tokens = max_request_tokens

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.fetching)

    def wait_for_kv(self, timeout_s: float) -> None:
        if self.fetching and not self.waiting and not self.running:
            self.fetching[0].fetch.handle.done.wait(timeout_s)

    def _settle_fetches(self) -> None:
        self.kv.poll_fetches()
        ready = [r for r in self.fetching if r.fetch.handle.done.is_set()]
        for req in reversed(ready):
            self.fetching.remove(req)
            req.skip_disk = True
            req.fetch = None
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.chunked_prefill_size
        batch: list[ScheduledSeq] = []
        num_preemptions = self.num_preemptions
        if self.fetching:
            self._settle_fetches()
        if self.proposer is not None:
            self.proposer.set_batch(sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running))
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, budget) if n == 1 else ()
            ahead = self._lookahead(req, n + len(draft)) if n == 1 else 0
            if self._allocate_or_preempt(req, n + len(draft) + ahead, batch):
                batch.append(self._seq(req, n + len(draft), draft, ahead))
                budget -= n + len(draft)
        # Admitting new work right after a preemption would only thrash the pages.
        if budget > 0 and self.num_preemptions == num_preemptions:
            self._admit(budget, batch)
        return batch

    def _seq(self, req: Request, num_tokens: int, draft: tuple[int, ...] = (),
             lookahead: int = 0) -> ScheduledSeq:
        """KV for [start, start + num_tokens), start = num_computed_tokens (with a draft: the last
        token + draft); `lookahead`: positions past it for a model draft to propose into."""
        start = req.num_computed_tokens
        end = start + num_tokens
        completes = end - len(draft) == req.num_tokens
        ids = req.token_slice(start, end - len(draft)) + list(draft)
        return ScheduledSeq(
            request_id=req.request_id, input_ids=ids, start_pos=start,
            page_ids=req.page_ids[:self.kv.pages_for(end + lookahead)],
            sample=completes and req.max_tokens > 0, params=req.params, seed=req.seed,
            prompt_ids=req.prompt_ids, output_ids=req.output_ids,
            min_tokens_left=max(req.params.min_tokens - len(req.output_ids), 0),
            prompt_logprob_start=(start if start < len(req.prompt_ids) and req.wants_prompt_logprobs
                                  else None),
            draft=draft, propose=lookahead)

    def _draft(self, req: Request, budget: int) -> tuple[int, ...]:
        """Draft tokens within max_tokens (less the verify step's own), the sequence limit and budget."""
        if self.proposer is None or req.params.grammar is not None:
            return ()
        limit = min(req.max_tokens - len(req.output_ids) - 1,
                    self.max_request_tokens - req.num_tokens - 1, budget - 1)
        if limit <= 0:
            return ()
        return tuple(self.proposer.propose(req.request_id, req.all_ids, limit))

    def _lookahead(self, req: Request, num_step_tokens: int) -> int:
        if (not isinstance(self.proposer, ModelDraftProposer) or req.params.grammar is not None
                or not self.proposer.wants_draft(req.request_id)):
            return 0
        room = self.max_request_tokens - (req.num_computed_tokens + num_step_tokens)
        return max(0, min(self.proposer.max_draft, room))

    def _allocate_or_preempt(self, req: Request, n: int, batch: list[ScheduledSeq]) -> bool:
        """Pages for n more tokens, preempting the newest others not in `batch`; False: req was preempted."""
        in_batch = {s.request_id for s in batch}
        while not self.kv.allocate(req, req.num_computed_tokens + n):
            victims = [r for r in self.running if r is not req and r.request_id not in in_batch]
            self.preempt(victims[-1] if victims else req)
            if not victims:
                return False
        return True

    def _admit(self, budget: int, batch: list[ScheduledSeq]) -> None:
        prefilling = [r for r in self.running if r.is_prefilling]
        for req in self._policy_order():
            if len(self.running) >= self.config.max_running_requests:
                break
            cached = self.kv.match(req, keep_free_pages=len(self.running) + 1)
            if req.fetch is not None:
                self.kv.free(req)
                req.num_computed_tokens = 0
                self.waiting.remove(req)
                req.status = Status.WAITING_FOR_KV
                self.fetching.append(req)
                continue
            if self._shares_uncached_prefix(req, prefilling):
                self.kv.free(req)
                req.num_computed_tokens = 0
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # Headroom: one page per running request for its next decode steps.
            reserve = len(self.running)
            fits = self.kv.pages_for(req.num_computed_tokens + n) - len(req.page_ids) + reserve
            if fits > self.kv.num_available_pages or not self.kv.allocate(req, req.num_computed_tokens + n):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.remove(req)
            if not req.is_admitted:  # a recompute after preemption is not a cache hit
                req.num_cached_tokens = cached
                req.num_host_cached_tokens = req.num_host_hit_tokens
                req.queue_time_s = time.monotonic() - req.arrival_s
            req.status = Status.RUNNING
            self.running.append(req)
            prefilling.append(req)
            batch.append(self._seq(req, n))
            budget -= n
            if budget <= 0:
                break

    def _policy_order(self) -> list[Request]:
        waiting = list(self.waiting)
        if self.config.schedule_policy == "lpm" and len(waiting) <= self.config.lpm_queue_threshold:
            waiting.sort(key=lambda r: -self.kv.match_len(r))
        return waiting

    def _shares_uncached_prefix(self, req: Request, prefilling: list[Request]) -> bool:
        """Another request is prefilling req's next page: req waits, then hits the cache."""
        if not self.kv.enable_cache:
            return False
        end = req.num_computed_tokens + self.kv.page_size
        if end > req.num_tokens - 1:
            return False
        head = req.all_ids[:end]
        return any(r.num_tokens >= end and r.all_ids[:end] == head for r in prefilling)

    def preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def requeue(self, req: Request) -> None:
        """A request that read a failed host load: recompute first, without host hits or their credit."""
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.skip_host_tier = True
        req.num_cached_tokens -= req.num_host_cached_tokens
        req.num_host_cached_tokens = 0
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """End `req` wherever it is: in a queue here, or held outside them (a PD side's)."""
        queue = next((q for q in (self.running, self.waiting, self.fetching) if req in q), None)
        if queue is not None:
            queue.remove(req)
        req.fetch = None     # a fetch in flight still lands, into the tree
        self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        if self.proposer is not None:
            self.proposer.release(req.request_id, req.all_ids if reason != "abort" else None,
                                  len(req.output_ids))
