"""ProfilerHooks: a trace of the engine's steps, started and stopped by the `profile` call, ends by itself after num_steps; bad calls are 400s that leave the engine serving."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.runner.profiler import ProfilerHooks
from radixserve.sampling_params import SamplingParams
from tests.unit.fake_runner import FakeRunner


def engine_with(profiler: ProfilerHooks) -> Engine:
    return Engine(EngineConfig(page_size=4), FakeRunner(), hooks=[profiler])


def run(engine: Engine, rid: str, max_tokens: int) -> int:
    """Serve one request to its end; the number of steps it took."""
    engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_a_trace_of_num_steps_is_written_by_itself(tmp_path):
    profiler = ProfilerHooks(str(tmp_path / "traces"))
    engine = engine_with(profiler)
    assert profiler.profile("start", num_steps=3) == {"output_dir": str(tmp_path / "traces"), "num_steps": 3}
    assert run(engine, "a", 8) > 3
    assert profiler.steps == 3 and profiler.last_trace is not None
    assert pathlib.Path(profiler.last_trace).parent == tmp_path / "traces"
    assert isinstance(events(profiler.last_trace), list)
    with pytest.raises(InvalidRequest, match="not running; the last trace is"):
        profiler.profile("stop")


def test_start_then_stop_records_every_step_between(tmp_path):
    profiler = ProfilerHooks(str(tmp_path))
    engine = engine_with(profiler)
    profiler.profile("start")
    steps = run(engine, "a", 5)
    answer = profiler.profile("stop")
    assert answer["num_steps"] == steps and pathlib.Path(answer["trace"]).is_file()
    profiler.profile("start")
    second = profiler.profile("stop")
    assert second["trace"] != answer["trace"] and second["num_steps"] == 0


def test_bad_calls_are_refused_and_the_engine_keeps_serving(tmp_path):
    profiler = ProfilerHooks(str(tmp_path))
    engine = engine_with(profiler)
    with pytest.raises(InvalidRequest, match="not running"):
        profiler.profile("stop")
    for bad in (0, -1, 1.5, "3", True):
        with pytest.raises(InvalidRequest, match="num_steps"):
            profiler.profile("start", num_steps=bad)
    with pytest.raises(InvalidRequest, match="unknown profile action"):
        profiler.profile("pause")
    profiler.profile("start")
    with pytest.raises(InvalidRequest, match="already running"):
        profiler.profile("start")
    assert run(engine, "a", 4) == 4
    assert profiler.profile("stop")["num_steps"] == 4


def test_an_unusable_directory_is_a_start_up_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--torch-profiler-dir"):
        ProfilerHooks(str(tmp_path / "file" / "traces"))
