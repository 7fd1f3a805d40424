"""EngineHooks: the one seam where optional features attach to the Engine (KV checksums, fault injection, a PD side)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.engine.request import Request
from radixserve.outputs import EngineOutput, TokenLogprob


class EngineHooks:
    """Does nothing; subclasses override what they need. Every call runs on the engine thread.
    One request sees: on_add, then per step before_schedule / on_tokens / after_step, then
    on_finish or on_abort (its KV still held in both). KV page events: `attach` may set the
    engine's `kv.pool.on_free` (told of every freed batch of pages)."""

    def attach(self, engine: Any) -> None:
        """Called once by the Engine's constructor, with the Engine. Raises ValueError when the
        hook cannot serve that engine (a runner without what it needs)."""

    def on_add(self, req: Request) -> None:
        """`req` passed validation and is being queued."""

    def before_schedule(self) -> None:
        """Start of each step, before the scheduler picks its work."""

    def on_tokens(self, req: Request, tokens: list[TokenLogprob]) -> list[TokenLogprob]:
        """The tokens `req` emits for one step's samples (one, or a verified speculative run).
        May replace tokens and cut the run; only the last may differ from its sample."""
        return tokens

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        """`req` finished (not aborted); returns its final output, `out` or a replacement."""
        return out

    def on_abort(self, req: Request) -> None:
        """`req` is aborted or withdrawn; its final output is the engine's."""

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        """End of a step that ran work; `running`: its requests still RUNNING. Returns the
        outputs of requests the hook ended itself."""
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

    def on_tokens(self, req: Request, tokens: list[TokenLogprob]) -> list[TokenLogprob]:
        for h in self.hooks:
            tokens = h.on_tokens(req, tokens)
        return tokens

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        for h in self.hooks:
            out = h.on_finish(req, out)
        return out

    def on_abort(self, req: Request) -> None:
        for h in self.hooks:
            h.on_abort(req)

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        return [out for h in self.hooks for out in h.after_step(running)]
