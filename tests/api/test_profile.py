"""POST /start_profile and /stop_profile (as SGLang's): a torch profiler trace of the engine's steps with --torch-profiler-dir, a 400 without it or for a bad body, the server serving throughout."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from tests.api.conftest import start_tiny_server
from tests.api.test_api_errors import assert_error


@pytest.fixture(scope="module")
def profiled(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    server = start_tiny_server(request, ["--torch-profiler-dir", str(folder)])
    yield server, folder
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def test_a_trace_holds_the_forward_of_the_requests_between_start_and_stop(profiled):
    server, folder = profiled
    r = server.post("/start_profile")
    assert r.status_code == 200 and r.json()["output_dir"] == str(folder), r.text
    r = server.post("/v1/completions", json={"model": server.model, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    stop = server.post("/stop_profile")
    assert stop.status_code == 200, stop.text
    trace = pathlib.Path(stop.json()["trace"])
    assert trace.parent == folder and stop.json()["num_steps"] == 3
    with gzip.open(trace, "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]


def test_num_steps_ends_the_trace_by_itself_and_bad_calls_are_400s(profiled):
    server, folder = profiled
    assert_error(server.post("/stop_profile"), 400)
    for body in ({"num_steps": 0}, {"num_steps": "two"}, {"output_dir": "/etc"}):
        assert_error(server.post("/start_profile", json=body), 400)
    assert server.post("/start_profile", json={"num_steps": 2}).status_code == 200
    assert_error(server.post("/start_profile"), 400)
    r = server.post("/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
    err = assert_error(server.post("/stop_profile"), 400)
    assert "the last trace is" in err["message"], err
    server.assert_alive()


def test_without_the_flag_the_profiler_is_off(tiny_server):
    err = assert_error(tiny_server.post("/start_profile"), 400)
    assert "--torch-profiler-dir" in err["message"]
    tiny_server.assert_alive()
