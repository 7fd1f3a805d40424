"""EngineHooks: the one seam where optional features attach to the Engine (KV checksums, fault injection, a PD side)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.engine.request import Request
from radixserve.outputs import EngineOutput, TokenLogprob


class EngineHooks:
    """No-op base; engine thread only. A request sees on_add, per step before_schedule, on_tokens, after_step, then
    on_finish or on_abort, KV still held. on_finish and after_step may abort others (their on_abort runs inside)."""

    def attach(self, engine: Any) -> None:
        """Once, from Engine.__init__; raises ValueError when the engine lacks what it needs."""

    def on_add(self, req: Request) -> None:
        """`req` was validated and is about to be queued."""
        pass

    def before_schedule(self) -> None:
        """Start of every step, before the scheduler picks its batch."""
        pass

    def on_tokens(self, req: Request, token_ids: list[int], logprobs: Sequence[TokenLogprob] | None
                  ) -> tuple[list[int], Sequence[TokenLogprob] | None]:
        """`req`'s tokens of one step and their logprobs (None: not wanted), maybe cut or the last one replaced."""
        return token_ids, logprobs

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        """`req`'s final output, maybe replaced; its KV is still held."""
        return out

    def on_abort(self, req: Request) -> None:
        """`req` is aborted or withdrawn; its KV is still held."""
        pass

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        """`running`: the step's requests still RUNNING; returns outputs of requests it ended."""
        return []


class HookChain(EngineHooks):
    """Several hooks, called in order; on_tokens and on_finish pass their value along."""

    def __init__(self, hooks: Sequence[EngineHooks] = ()):
        self.hooks = list(hooks)

    def attach(self, engine: Any) -> None:
        for h in self.hooks:
            h.attach(engine)

    def on_add(self, req: Request) -> None:
        for h in self.hooks:
            h.on_add(req)

    def before_schedule(self) -> None:
        for h in self.hooks:
            h.before_schedule()

    def on_tokens(self, req: Request, token_ids: list[int], logprobs: Sequence[TokenLogprob] | None
                  ) -> tuple[list[int], Sequence[TokenLogprob] | None]:
        for h in self.hooks:
            token_ids, logprobs = h.on_tokens(req, token_ids, logprobs)
        return token_ids, logprobs

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        for h in self.hooks:
            out = h.on_finish(req, out)
        return out

    def on_abort(self, req: Request) -> None:
        for h in self.hooks:
            h.on_abort(req)

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        return [out for h in self.hooks for out in h.after_step(running)]
