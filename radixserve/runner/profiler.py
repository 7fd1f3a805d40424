"""ProfilerHooks (--torch-profiler-dir): a torch profiler trace of the engine's steps, started and stopped by the engine's `profile` call."""
from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import Any

import torch

from radixserve.engine.hooks import EngineHooks
from radixserve.engine.request import Request
from radixserve.errors import InvalidRequest
from radixserve.outputs import EngineOutput

logger = logging.getLogger(__name__)


class ProfilerHooks(EngineHooks):
    """One trace at a time, recorded on the engine thread from `profile("start")` until `profile("stop")` or `num_steps`
    steps with a batch, written as a gzipped Chrome trace (chrome://tracing, Perfetto) into `output_dir`."""

    def __init__(self, output_dir: str):
        """Creates `output_dir`; ValueError where it cannot."""
        self.output_dir = pathlib.Path(output_dir)
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--torch-profiler-dir {output_dir}: {exc}") from None
        self._count = 0
        self._prof: torch.profiler.profile | None = None
        self._num_steps: int | None = None
        self.steps = 0
        self.last_trace: str | None = None

    def profile(self, action: str = "start", num_steps: int | None = None) -> dict[str, Any]:
        """InvalidRequest (400): bad `action` ("start" | "stop"), start if recording, stop if idle, num_steps < 1."""
        if action == "start":
            return self._start(num_steps)
        if action == "stop":
            if self._prof is None:
                last = f"; the last trace is {self.last_trace}" if self.last_trace else ""
                raise InvalidRequest(f"the profiler is not running{last}")
            return {"trace": self._finish(), "num_steps": self.steps}
        raise InvalidRequest(f"unknown profile action {action!r}: expected start or stop", param="action")

    def _start(self, num_steps: int | None) -> dict[str, Any]:
        if self._prof is not None:
            raise InvalidRequest("the profiler is already running: POST /stop_profile first")
        if num_steps is not None and (type(num_steps) is not int or num_steps < 1):
            raise InvalidRequest(f"num_steps must be a positive integer, got {num_steps!r}", param="num_steps")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.start()
        self._num_steps, self.steps = num_steps, 0
        return {"output_dir": str(self.output_dir), "num_steps": num_steps}

    def after_step(self, running: list[Request]) -> list[EngineOutput]:
        if self._prof is not None:
            self.steps += 1
            if self._num_steps is not None and self.steps >= self._num_steps:
                self._finish()
        return []

    def _finish(self) -> str | None:
        """The trace's path; None (logged) where it could not be written."""
        prof, self._prof = self._prof, None
        prof.stop()
        self._count += 1
        name = f"radixserve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._count}.trace.json.gz"
        try:
            prof.export_chrome_trace(str(self.output_dir / name))
        except OSError:
            logger.exception("profiler trace not written to %s", self.output_dir)
            return None
        self.last_trace = str(self.output_dir / name)
        logger.info("profiler trace of %d steps: %s", self.steps, self.last_trace)
        return self.last_trace
