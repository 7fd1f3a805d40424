"""Engine: add_request / abort / step() = schedule -> run -> update, over any Runner (docs/architecture.md)."""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from radixserve.engine.hooks import EngineHooks, HookChain
from radixserve.engine.kv_checksum import ChecksumHooks
from radixserve.engine.kv_manager import KVManager
from radixserve.engine.request import Request, Status
from radixserve.engine.runner_api import Runner, ScheduledSeq, SeqResult
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.speculative import resolve_break_even
from radixserve.engine_config import EngineConfig
from radixserve.errors import ContextLengthExceeded, InvalidRequest
from radixserve.outputs import EngineOutput, SpecCounts, TokenLogprob
from radixserve.sampling_params import SamplingParams


class Engine:
    """Continuous-batching engine, one thread; the front end matches stop strings (abort(id, "stop"))."""

    def __init__(self, config: EngineConfig, runner: Runner,
                 extra_eos_token_ids: frozenset[int] = frozenset(),
                 hooks: Sequence[EngineHooks] = ()):
        """`extra_eos_token_ids`: the tokenizer's, besides the model's. Raises ValueError if a hook can't serve it."""
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(runner.eos_token_ids) | frozenset(extra_eos_token_ids)
        self.page_size = runner.page_size
        self.max_context_len = runner.max_context_len
        self.kv = KVManager(runner.num_pages, runner.page_size, not config.disable_radix_cache,
                            getattr(runner, "host_kv", None), config.hicache_write_policy,
                            paired_keys=config.is_eagle, num_fp8_pages=getattr(runner, "num_fp8_pages", 0))
        self.scheduler = Scheduler(config, self.kv, self.max_request_tokens, resolve_break_even(
            config.speculative_break_even_tokens, runner.info().get("quantization")))
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.random_seed)
        self.counters = {"num_prompt_tokens": 0, "num_cached_tokens": 0, "num_generated_tokens": 0,
                         "num_cached_tokens_host": 0,
                         "num_finished_requests": 0, "num_aborted_requests": 0,
                         "spec_num_verify_steps": 0, "spec_num_draft_tokens": 0,
                         "spec_num_accepted_tokens": 0,
                         "spec_num_draft_by_position": [0] * config.spec_max_draft,
                         "spec_num_accepted_by_position": [0] * config.spec_max_draft}
        if config.enable_kv_checksum and not any(isinstance(h, ChecksumHooks) for h in hooks):
            raise ValueError("--enable-kv-checksum needs ChecksumHooks among the hooks (compose.engine_hooks)")
        self.hooks = HookChain(hooks) if hooks else None   # None: the plain path calls no hook
        if self.hooks:
            self.hooks.attach(self)

    def add_eos_token_ids(self, token_ids: list[int]) -> None:
        self.eos_token_ids = self.eos_token_ids | frozenset(int(t) for t in token_ids)

    @property
    def max_request_tokens(self) -> int:
        return min(self.max_context_len, self.kv.num_model_pages * self.page_size)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request (the one client-input validator); InvalidRequest or ContextLengthExceeded queue nothing."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        params.validate(self.runner.vocab_size)
        validate = getattr(self.runner, "validate_params", None)
        if validate is not None:
            validate(params)
        if params.n != 1:
            raise InvalidRequest("the engine takes n=1; fan out choices before add_request", param="n")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: at least one token is required", param="prompt")
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is out of range [0, {vocab})", param="prompt")
        max_tokens = self._max_tokens(len(prompt_ids), params.max_tokens)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, list(prompt_ids), params, seed, max_tokens, time.monotonic())
        if self.hooks:
            self.hooks.on_add(req)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        limit = self.max_request_tokens
        wanted = max_tokens if max_tokens is not None else 1
        if num_prompt_tokens + wanted <= limit:
            return max_tokens if max_tokens is not None else limit - num_prompt_tokens
        what = (f"{max_tokens} for the completion" if max_tokens is not None
                else "at least 1 for the completion")
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, {what}). "
            "Please reduce the length of the prompt or max_tokens.",
            param="max_tokens" if num_prompt_tokens < limit and max_tokens else "prompt")

    def abort(self, request_id: str, reason: str = "abort") -> EngineOutput | None:
        """Stop a request; its computed KV stays cached. Returns its final output (None: unknown
        id). `reason` "stop" (a matched stop string) counts as finished, anything else as aborted."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.hooks:
            self.hooks.on_abort(req)
        self.scheduler.finish(req, reason)
        self.counters["num_finished_requests" if reason == "stop" else "num_aborted_requests"] += 1
        self._count_prompt(req)
        return self._output(req, [], None, reason)

    def withdraw(self, request_id: str) -> None:
        """Take back a request added before any step (a PD side refused it): no output, no counters."""
        req = self.requests.pop(request_id)
        if self.hooks:
            self.hooks.on_abort(req)
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Release what the runner holds beyond this process (a tensor-parallel group's followers), if anything."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def step(self) -> list[EngineOutput]:
        if self.hooks:
            self.hooks.before_schedule()
        batch = self.scheduler.schedule()
        if not batch:
            self.scheduler.wait_for_kv(0.01)
            return []
        reqs = [self.requests[seq.request_id] for seq in batch]
        results = self.runner.run(batch)
        for req in self.kv.finish_loads(reqs):
            self.scheduler.requeue(req)   # it read a failed host load: recompute, no output
        outs = self._update(batch, reqs, results)
        if self.hooks:
            outs += self.hooks.after_step([r for r in reqs if r.status is Status.RUNNING])
        return outs

    def _update(self, batch: list[ScheduledSeq], reqs: list[Request],
                results: list[SeqResult]) -> list[EngineOutput]:
        outs: list[EngineOutput] = []
        for seq, req, res in zip(batch, reqs, results):
            if req.status is not Status.RUNNING:
                continue
            if seq.draft:
                outs.append(self._verified(req, seq, res))
                self._offer(req, res)
                continue
            req.num_computed_tokens = seq.start_pos + len(seq.input_ids)
            if seq.prompt_logprob_start is not None and res.prompt_logprobs is not None:
                req.prompt_logprobs = (req.prompt_logprobs or []) + res.prompt_logprobs
            if len(seq.input_ids) > 1:
                self.kv.commit(req)
            if req.num_computed_tokens != req.num_tokens:
                continue
            if not res.token_ids:  # max_tokens == 0: prompt scored, nothing to sample
                outs.append(self.finish(req, "length"))
                continue
            outs.append(self.emit(req, *self._on_tokens(req, list(res.token_ids), res.logprobs)))
            self._offer(req, res)
        return outs

    def _offer(self, req: Request, res: SeqResult) -> None:
        if res.next_draft and req.status is Status.RUNNING:
            self.scheduler.proposer.offer(req.request_id, res.next_draft, req.num_tokens)

    def emit(self, req: Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None,
             computed: Callable[[int], int] | None = None) -> EngineOutput:
        """Append tokens one by one until one finishes `req` (the rest dropped); `logprobs`: one per token, kept if
        wanted. `computed(kept)`: num_computed_tokens after `kept` tokens, set before a finish commits the pages."""
        ids: list[int] = []
        reason = None
        for t in token_ids:
            req.output_ids.append(t)
            self.counters["num_generated_tokens"] += 1
            ids.append(t)
            reason = self._finish_reason(req, t)
            if reason is not None:
                break
        if computed is not None:
            req.num_computed_tokens = computed(len(ids))
        logprobs = list(logprobs[:len(ids)]) if logprobs is not None and req.params.wants_logprobs else None
        if reason is not None:
            return self._finish(req, ids, logprobs, reason)
        return self._output(req, ids, logprobs)

    def _verified(self, req: Request, seq: ScheduledSeq, res: SeqResult) -> EngineOutput:
        """Rejected drafts' KV stays in the private tail past num_computed_tokens, never committed."""
        c, draft = self.counters, seq.draft
        accepted = len(res.token_ids) - 1
        c["spec_num_verify_steps"] += 1
        c["spec_num_draft_tokens"] += len(draft)
        c["spec_num_accepted_tokens"] += accepted
        for i in range(len(draft)):
            c["spec_num_draft_by_position"][i] += 1
            c["spec_num_accepted_by_position"][i] += i < accepted
        spec = req.spec or SpecCounts()
        req.spec = SpecCounts(spec.verify_steps + 1, spec.draft_tokens + len(draft),
                              spec.accepted_tokens + accepted)
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.record(req.request_id, len(draft), accepted)
        sampled = list(res.token_ids)
        ids, logprobs = self._on_tokens(req, sampled, res.logprobs)
        num_as_sampled = next((i for i, (t, u) in enumerate(zip(ids, sampled)) if t != u), len(ids))
        return self.emit(req, ids, logprobs,
                         lambda kept: seq.start_pos + 1 + min(kept, accepted, num_as_sampled))

    def _on_tokens(self, req: Request, token_ids: list[int], logprobs: Sequence[TokenLogprob] | None
                   ) -> tuple[list[int], Sequence[TokenLogprob] | None]:
        return self.hooks.on_tokens(req, token_ids, logprobs) if self.hooks else (token_ids, logprobs)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if len(req.output_ids) > p.min_tokens or p.min_tokens == 0:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                req.stop_token_id = token
                return "stop"
        if len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_request_tokens:
            return "length"
        return None

    def finish(self, req: Request, reason: str) -> EngineOutput:
        return self._finish(req, [], None, reason)

    def _finish(self, req: Request, new_ids: list[int], logprobs, reason: str) -> EngineOutput:
        out = self._output(req, new_ids, logprobs, reason)
        if self.hooks:
            out = self.hooks.on_finish(req, out)
        self.scheduler.finish(req, reason)
        del self.requests[req.request_id]
        self.counters["num_finished_requests"] += 1
        self._count_prompt(req)
        return out

    def _count_prompt(self, req: Request) -> None:
        if req.is_admitted:
            self.counters["num_prompt_tokens"] += len(req.prompt_ids)
            self.counters["num_cached_tokens"] += req.num_cached_tokens
            self.counters["num_cached_tokens_host"] += req.num_host_cached_tokens

    def _output(self, req: Request, new_ids: list[int], logprobs,
                reason: str | None = None) -> EngineOutput:
        prompt_lp = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and not req.is_prefilling:
            prompt_lp, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return EngineOutput(
            request_id=req.request_id, new_token_ids=new_ids, new_logprobs=logprobs,
            finished=reason is not None, finish_reason=reason,
            stop_token_id=req.stop_token_id, num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.num_cached_tokens, prompt_logprobs=prompt_lp,
            queue_time_s=req.queue_time_s, spec=req.spec,
            num_cached_tokens_host=req.num_host_cached_tokens if self.kv.tier is not None else None)

    def stats(self) -> dict:
        kv, c = self.kv, self.counters
        used = kv.num_pages - kv.pool.num_free - kv.cache.num_evictable_pages
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "num_pages": kv.num_pages, "page_size": self.page_size,
            "num_free_pages": kv.pool.num_free, "num_cached_pages": kv.cache.num_cached_pages,
            "num_evictable_pages": kv.cache.num_evictable_pages,
            **({"num_fp8_pages": kv.pool.num_fp8_pages, "num_free_fp8_pages": kv.pool.num_free_fp8}
               if kv.pool.num_fp8_pages else {}),
            "token_usage": used / kv.num_pages,
            "cache_hit_rate": c["num_cached_tokens"] / c["num_prompt_tokens"] if c["num_prompt_tokens"] else 0.0,
            "num_preemptions": self.scheduler.num_preemptions, **c,
            "num_cached_tokens_device": c["num_cached_tokens"] - c["num_cached_tokens_host"],
            **(kv.tier.stats() if kv.tier is not None else {}),
            **(kv.disk.stats() if kv.disk is not None else {}),
            "num_waiting_for_kv": len(self.scheduler.fetching),
            "runner": self.runner.info(),
        }

    def flush_cache(self) -> bool:
        """Drop every cached prefix and the shared n-gram table; False (refused) while requests hold KV."""
        if self.has_unfinished() or not self.kv.flush():
            return False
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.flush()
        return True

    def check_invariants(self, other_owners: Sequence = ()) -> None:
        self.kv.check_invariants(self.scheduler.running + list(self.scheduler.waiting)
                                 + self.scheduler.fetching + list(other_owners))
