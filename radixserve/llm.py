"""Offline API: LLM.generate / LLM.chat run the engine in-process, with a progress bar; LLM.stream_chat yields one reply as it is generated."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from radixserve.compose import engine_hooks
from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams


class LLM:
    """Load a model and generate from it in this process.

        llm = LLM()                                   # embedded SmolLM2-135M-Instruct
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        print(outs[0].outputs[0].text)

    model_path: HF directory or .gguf file (None = embedded default). Other keyword
    arguments are EngineConfig fields (page_size, dtype, max_total_tokens, ...).
    Raises ModelPathError (a FileNotFoundError) naming what a bad model_path lacks.
    """

    def __init__(self, model_path: str | None = None, **engine_kwargs):
        from radixserve.runner.model_runner import ModelRunner
        from radixserve.tokenizer.tokenizer import Tokenizer
        from radixserve.weights.paths import resolve_model_path

        self.config = EngineConfig(model_path=model_path, **engine_kwargs)
        self.tokenizer = Tokenizer.load(resolve_model_path(model_path, need_tokenizer=True))
        runner = ModelRunner.from_config(self.config)
        self.engine = Engine(self.config, runner, self.tokenizer.eos_token_ids,
                             engine_hooks(self.config))
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for text prompts or token-id prompts; results keep the input order.

        Raises InvalidRequest / ContextLengthExceeded (before anything runs) for bad input.
        """
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
        """Apply the chat template to one conversation and yield the reply's text as it is
        generated, one delta per engine step (stop strings held back and trimmed as in `chat`).
        params.n must be 1 (ValueError otherwise). Closing the generator early (a `break`, or
        KeyboardInterrupt while it runs) aborts the request, so its pages return to the pool.
        Raises InvalidRequest / ContextLengthExceeded before anything runs, like `chat`."""
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
            for child_id in owner:   # a no-op for a finished request
                self.engine.abort(child_id)

    def stats(self) -> dict:
        """Engine counters: hit rate, pool usage (see Engine.stats)."""
        return self.engine.stats()

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
            for child_id in owner:  # leave no request behind in the engine
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
        """Step the engine until it has nothing left; yield (tracker, ChoiceUpdate) for every
        output of a request in `owner` (child request id -> its RequestTracker)."""
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tracker = owner.get(out.request_id)
                if tracker is None:
                    continue
                update = tracker.process(out)
                if update.abort_child is not None:   # its stop string matched
                    self.engine.abort(update.abort_child, reason="stop")
                yield tracker, update
