"""Structured output: grammar-constrained decoding against a JSON schema or a structural tag with xgrammar, masks built for the whole batch.

A request's matcher replays its unseen output ids (recompute needs nothing); a complete grammar allows only EOS.
JSON is compact (any_whitespace=False): with free whitespace small models pad until max_tokens."""
from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.errors import InvalidRequest
from radixserve.layers.sampler import SampleRow

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps xgrammar apache-tvm-ffi"
Grammar = tuple[str, str]   # SamplingParams.grammar: ("json_schema" | "structural_tag", text)


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)


class StructuredOutput:
    """Per-runner grammar state (compiles cached with their failures, thread-safe); `vocab_size`: the logit width."""

    def __init__(self, model_path: str | None, vocab_size: int, eos_token_ids: frozenset[int],
                 max_matchers: int = 1024, max_grammars: int = 256):
        self.model_path, self.vocab_size = model_path, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_matchers, self.max_grammars = max_matchers, max_grammars
        self._xgr: Any = None
        self._compiler: Any = None
        self._grammars: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.RLock()
        self._matchers: OrderedDict[str, tuple[Grammar, Any, int]] = OrderedDict()

    def _ensure_compiler(self) -> Any:
        with self._lock:
            return self._compiler or self._make_compiler()

    def _make_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError as exc:
                raise InvalidRequest(f"structured output needs the xgrammar package ({INSTALL_HINT})",
                                     param="response_format") from exc
            from radixserve.tokenizer.tokenizer import Tokenizer

            from radixserve.weights.paths import resolve_model_path

            tokenizer = Tokenizer.load(str(resolve_model_path(self.model_path)))
            stop = sorted(set(self.eos_token_ids) | set(tokenizer.eos_token_ids))
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=self.vocab_size,
                                                           stop_token_ids=stop)
            self._xgr, self._compiler = xgrammar, xgrammar.GrammarCompiler(info)
            self.eos_token_ids = stop
            logger.info("structured output: xgrammar ready (%d-token vocabulary)", self.vocab_size)
        return self._compiler

    def check(self, grammar: Grammar, param: str = "response_format") -> None:
        """Compile `grammar`, cached; InvalidRequest (naming `param`) when xgrammar is missing or refuses it."""
        try:
            self._grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = "the JSON schema" if grammar[0] == "json_schema" else "the tool-call grammar"
            raise InvalidRequest(f"{param}: {what} cannot be used: {_reason(exc)}", param=param) from exc

    def is_compiled(self, grammar: Grammar) -> bool:
        with self._lock:
            return grammar in self._grammars

    def _grammar(self, grammar: Grammar) -> Any:
        with self._lock:
            compiler = self._ensure_compiler()
            cached = self._grammars.get(grammar)
            if cached is not None:
                self._grammars.move_to_end(grammar)
        if cached is None:
            kind, text = grammar
            try:
                cached = (compiler.compile_json_schema(text, any_whitespace=False) if kind == "json_schema"
                          else compiler.compile_structural_tag(text))
            except (RuntimeError, ValueError, TypeError) as exc:
                cached = exc
            with self._lock:
                self._grammars[grammar] = cached
                if len(self._grammars) > self.max_grammars:
                    self._grammars.popitem(last=False)
        if isinstance(cached, Exception):
            raise cached
        return cached

    def token_mask(self, rows: Sequence[SampleRow], device: torch.device) -> Callable[[torch.Tensor], None] | None:
        """A function setting in place to -inf the logits (n, vocab_size) row i may not sample; None if unconstrained."""
        constrained = [i for i, r in enumerate(rows) if r.params.grammar is not None]
        if not constrained:
            return None
        self._ensure_compiler()
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i in constrained:
            matcher = self._matcher(rows[i])
            if matcher is None or matcher.is_terminated():
                bitmask[i] = 0
                for tid in self.eos_token_ids:
                    word, bit = divmod(tid, 32)
                    bitmask[i, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        xgr = self._xgr

        def apply(logits: torch.Tensor) -> None:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                            indices=constrained)
        return apply

    def _matcher(self, row: SampleRow) -> Any:
        """The row's matcher advanced over its output ids; None once an output token broke the grammar."""
        grammar, rid = row.params.grammar, row.request_id
        entry = self._matchers.get(rid)
        if entry is None or entry[0] != grammar or entry[2] > len(row.output_ids):
            entry = (grammar, self._xgr.GrammarMatcher(self._grammar(grammar)), 0)
        grammar, matcher, seen = entry
        for token in row.output_ids[seen:]:
            if matcher is None:
                break
            if matcher.is_terminated() or not matcher.accept_token(token):
                matcher = None
        self._matchers[rid] = (grammar, matcher, len(row.output_ids))
        self._matchers.move_to_end(rid)
        if len(self._matchers) > self.max_matchers:
            self._matchers.popitem(last=False)
        return matcher
