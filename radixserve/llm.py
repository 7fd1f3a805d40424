"""Offline API: LLM.generate / LLM.chat / LLM.stream_chat run the engine in this process."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from radixserve.compose import engine_hooks
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams


class LLM:
    """`model_path`: HF folder, .gguf or None (embedded); kwargs: EngineConfig fields; ModelPathError: what it lacks."""

    def __init__(self, model_path: str | None = None, **engine_kwargs):
        from radixserve.runner.tp import load_runner
        from radixserve.tokenizer.tokenizer import Tokenizer
        from radixserve.weights.default_draft import with_default_draft
        from radixserve.weights.paths import resolve_model_path

        self.config = with_default_draft(EngineConfig(model_path=model_path, **engine_kwargs))
        self.tokenizer = Tokenizer.load(resolve_model_path(model_path, need_tokenizer=True))
        runner = load_runner(self.config)
        self.engine = Engine(self.config, runner, self.tokenizer.eos_token_ids,
                             engine_hooks(self.config))
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Results keep the input order; InvalidRequest / ContextLengthExceeded before anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for prompt in prompts:
            if isinstance(prompt, str):
                items.append((prompt, self.tokenizer.encode(prompt)))
            else:
                items.append((None, list(prompt)))
        return self._run(items, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        items = [(None, self.tokenizer.apply_chat_template(conv)) for conv in conversations]
        return self._run(items, sampling_params, use_tqdm)

    def stream_chat(self, messages: list[dict],
                    sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields a reply's text, one delta per step (n > 1: ValueError); closing early aborts. Raises as `chat`."""
        from radixserve.server.tracker import RequestTracker

        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream_chat generates one reply: sampling_params.n must be 1")
        ids = self.tokenizer.apply_chat_template(messages)
        tracker = RequestTracker(str(next(self._ids)), ids, params, self.tokenizer)
        owner: dict = {}
        try:
            for child_id, child_params in tracker.child_requests():
                self.engine.add_request(child_id, ids, child_params)
                owner[child_id] = tracker
            for _, update in self._updates(owner):
                if update.text:
                    yield update.text
        finally:
            for child_id in owner:
                self.engine.abort(child_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's other processes (the --tp-size followers); the LLM cannot generate afterwards."""
        self.engine.close()

    def _run(self, items, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        from radixserve.server.tracker import RequestTracker

        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(items)
        if len(sampling_params) != len(items):
            raise ValueError("sampling_params must be one object or one per prompt")
        trackers: list[tuple[RequestTracker, str | None]] = []
        owner: dict[str, RequestTracker] = {}
        try:
            for (text, ids), params in zip(items, sampling_params):
                tracker = RequestTracker(str(next(self._ids)), ids, params, self.tokenizer)
                trackers.append((tracker, text))
                for child_id, child_params in tracker.child_requests():
                    self.engine.add_request(child_id, ids, child_params)
                    owner[child_id] = tracker
            self._drive(owner, len(trackers), use_tqdm)
        except BaseException:
            for child_id in owner:
                self.engine.abort(child_id)
            raise
        results = []
        for tracker, text in trackers:
            result = tracker.result()
            result.prompt = text
            results.append(result)
        return results

    def _drive(self, owner: dict, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="generate", disable=not use_tqdm)
        done: set[int] = set()
        for tracker, _ in self._updates(owner):
            if tracker.finished and id(tracker) not in done:
                done.add(id(tracker))
                bar.update(1)
        bar.close()

    def _updates(self, owner: dict) -> Iterator[tuple]:
        """Step until idle; yield (tracker, ChoiceUpdate) per output of `owner`'s requests."""
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tracker = owner.get(out.request_id)
                if tracker is None:
                    continue
                update = tracker.process(out)
                if update.abort_child is not None:
                    self.engine.abort(update.abort_child, reason="stop")
                yield tracker, update
