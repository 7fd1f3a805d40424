"""Follow one plain streamed /v1/completions through a real worker: the modules and data types it uses.

    PYTHONPATH=. python benchmarks/request_path.py [--json] [--model-path DIR]

The worker is `radixserve serve` itself (cli.main, default flags plus --num-threads 1) on the
API tests' tiny random-weight Llama (tests/conftest.py build_tiny_api_model; `--model-path`
reuses one written by benchmarks/make_tiny_model.py). One request: prompt "Hello", stream=true,
temperature 0, max_tokens 4; no PD, faults, speculation or resume. It follows a warm-up request
with another prompt (not recorded), so one-time work on first use (lazily allocated buffers) is
not counted as the request path of a running server.

To see the engine, the engine process runs as a thread of this process: the spawn context's
Process is replaced by a thread that runs the same target with the same arguments (its ZMQ ipc
sockets, its runner factory), so the HTTP side, the wire and the engine loop are the real code.
Two process-level calls become thread-aware: signal.signal off the main thread is a no-op, and
os._exit off the main thread ends only that thread. This hooks the process start rather than one
engine function, so it survives the engine's internals being reorganised.

Recorded with sys.setprofile / threading.setprofile, call events only:
- modules: radixserve files whose functions are called between the request's start (just before
  the client sends it) and its end (the client has read the last byte of the stream), in every
  thread. Everything under layers/ counts as one module, everything under runner/attention/ as
  one; dataclass-generated methods (file "<string>") do not count, nor do resumptions of
  coroutines that were already suspended when the request started (Trace.start_request).
- types: radixserve classes that are dataclasses, msgspec Structs, pydantic models or
  NamedTuples (exceptions excluded) of which an instance is an argument, or an element of a
  list/tuple argument, of a call made from or into radixserve code during the request, minus
  those seen during the background phase (start-up and one GET /health, no generation).
  A type only ever passed from its own module to its own module (a module's private helper,
  such as an attention backend's metadata) is listed apart and not counted: the count is of
  the types that carry the request from module to module. So are, as in the review behind issue
  39, acknowledgements (ACKS) and pydantic models nested in another counted response model.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import inspect
import json
import multiprocessing
import os
import pathlib
import signal
import sys
import tempfile
import textwrap
import threading
import types

import httpx
import msgspec
import pydantic

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PKG = str(REPO / "radixserve") + os.sep
GROUPS = ("layers" + os.sep, os.path.join("runner", "attention") + os.sep)  # one module each
# Not counted, as in the review behind issue 39: an acknowledgement that carries no request data
# (the engine's answer to a Submit), and a response schema's nested parts (schema_parts).
ACKS = {"engine.messages.Submitted"}
SUSPENDABLE = (types.CoroutineType, types.AsyncGeneratorType, types.GeneratorType)
BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
WARMUP = {**BODY, "prompt": "Good morning"}   # no prefix shared with BODY's prompt


class Trace:
    """The profile function's state: phase None (off), "background", "warmup" (off), "request" or "after"."""

    def __init__(self):
        self.phase: str | None = None
        self.modules: collections.Counter[str] = collections.Counter()
        self.functions: dict[str, set[str]] = collections.defaultdict(set)
        self.types: collections.Counter[type] = collections.Counter()
        self.crossing: set[type] = set()   # seen passed between two different modules
        self.background: set[type] = set()
        self.suspended: set[int] = set()   # frames of coroutines suspended when the request starts
        self._is_data: dict[type, bool] = {}

    def start_request(self) -> None:
        """Enter the request phase. Coroutines already suspended (the server's serve loop, the
        engine client's receive loop) resume during the request without being passed through by
        it: their resumptions are not counted; what they call is."""
        self.suspended = {id(f) for o in gc.get_objects() if isinstance(o, SUSPENDABLE)
                          for f in (getattr(o, "cr_frame", None) or getattr(o, "ag_frame", None)
                                    or getattr(o, "gi_frame", None),) if f is not None}
        self.phase = "request"

    def is_data(self, cls: type) -> bool:
        known = self._is_data.get(cls)
        if known is None:
            known = self._is_data[cls] = (
                cls.__module__.split(".")[0] == "radixserve" and not issubclass(cls, BaseException)
                and (dataclasses.is_dataclass(cls) or issubclass(cls, msgspec.Struct | pydantic.BaseModel)
                     or (issubclass(cls, tuple) and hasattr(cls, "_fields"))))
        return known

    def note(self, value: object, caller: str | None, callee: str | None) -> None:
        values = value if type(value) in (list, tuple) else (value,)
        for v in values:
            cls = type(v)
            if not self.is_data(cls):
                continue
            if self.phase != "request":
                self.background.add(cls)
                continue
            self.types[cls] += 1
            if cls not in self.crossing and {caller, callee} - {None, home_of(cls)}:
                self.crossing.add(cls)

    def profile(self, frame, event, arg) -> None:
        if event != "call" or self.phase not in ("background", "request"):
            return
        code = frame.f_code
        if id(frame) in self.suspended:
            return
        callee = module_of(code.co_filename)
        if callee and self.phase == "request":
            self.modules[callee] += 1
            self.functions[callee].add(code.co_qualname)
        back = frame.f_back
        caller = module_of(back.f_code.co_filename) if back is not None else None
        if callee is None and caller is None:
            return
        num_args = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
                    + bool(code.co_flags & inspect.CO_VARKEYWORDS))
        if not num_args:
            return
        local = frame.f_locals
        if code.co_filename == "<string>" and code.co_varnames[0] == "self":   # a dataclass method
            callee = home_of(type(local.get("self")))
        for value in map(local.get, code.co_varnames[:num_args]):
            for v in value.values() if type(value) is dict else (value,):   # **kwargs: its values
                self.note(v, caller, callee)

    def result(self) -> dict[str, dict[str, int]]:
        """modules: {module: calls}; types: {type: calls}; private_types: the same, for types
        never passed between two modules (not counted)."""
        out: dict = {"modules": dict(sorted(self.modules.items())), "types": {}, "private_types": {}, "parts_and_acks": {},
                     "functions": {m: sorted(f) for m, f in sorted(self.functions.items())}}
        seen = [t for t in self.types if t not in self.background]
        parts = {q for t in seen if issubclass(t, pydantic.BaseModel) for q in schema_parts(t)}
        for t in sorted(seen, key=name_of):
            n, name = self.types[t], name_of(t)
            if t not in self.crossing:
                out["private_types"][name] = n
            elif t in parts or name in ACKS:
                out["parts_and_acks"][name] = n
            else:
                out["types"][name] = n
        return out


def schema_parts(model: type[pydantic.BaseModel]) -> set[type]:
    """The pydantic models nested in `model`'s fields (as X, X | None or list[X])."""
    found: set[type] = set()
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, pydantic.BaseModel):
                found.add(t)
            stack.extend(getattr(t, "__args__", ()))
    return found


def name_of(cls: type) -> str:
    return f"{cls.__module__.removeprefix('radixserve.')}.{cls.__qualname__}"


def home_of(cls: type) -> str | None:
    """The module (as module_of names it) that defines cls."""
    return module_of(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")


def module_of(filename: str) -> str | None:
    """'server/app.py', 'layers/*', 'runner/attention/*'; None outside radixserve."""
    if not filename.startswith(PKG):
        return None
    rel = filename[len(PKG):]
    for group in GROUPS:
        if rel.startswith(group):
            return group.replace(os.sep, "/") + "*"
    return rel.replace(os.sep, "/")


class ThreadProcess(threading.Thread):
    """The engine "process": multiprocessing's Process interface over a thread."""

    def __init__(self, target, args=(), kwargs=None, name=None, daemon=None):
        super().__init__(target=target, args=args, kwargs=kwargs or {}, name=name, daemon=True)
        self.pid = os.getpid()
        self.exitcode: int | None = None

    def run(self) -> None:
        try:
            super().run()
            self.exitcode = 0
        except SystemExit as exc:
            self.exitcode = exc.code if isinstance(exc.code, int) else 1

    def kill(self) -> None:   # a thread cannot be killed; the engine loop ends on Shutdown
        pass

    terminate = kill


def engine_in_a_thread() -> None:
    real_get_context, real_signal, real_exit = multiprocessing.get_context, signal.signal, os._exit

    def get_context(method=None):
        return types.SimpleNamespace(Process=ThreadProcess) if method == "spawn" else real_get_context(method)

    def on_main_thread() -> bool:
        return threading.current_thread() is threading.main_thread()

    def thread_signal(sig, handler):
        return real_signal(sig, handler) if on_main_thread() else signal.getsignal(sig)

    def thread_exit(code: int):
        if on_main_thread():
            real_exit(code)
        raise SystemExit(code)

    multiprocessing.get_context, signal.signal, os._exit = get_context, thread_signal, thread_exit


def drive(trace: Trace, base_url: str, model: str, done: dict) -> None:
    """The client: wait for /health (background), send the request (traced), stop the server."""
    try:
        with httpx.Client(base_url=base_url, timeout=300) as http:
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                threading.Event().wait(0.2)
            trace.phase = "warmup"
            with http.stream("POST", "/v1/completions", json={"model": model, **WARMUP}) as r:
                done["warmup_lines"] = [line for line in r.iter_lines() if line]
            trace.start_request()
            with http.stream("POST", "/v1/completions", json={"model": model, **BODY}) as r:
                done["lines"] = [line for line in r.iter_lines() if line]
            done["status"] = r.status_code
    finally:
        trace.phase = "after"
        os.kill(os.getpid(), signal.SIGTERM)   # GracefulServer drains, serve() returns


def run(model_path: pathlib.Path, port: int) -> Trace:
    from radixserve.cli import main

    trace = Trace()
    done: dict = {}
    client = threading.Thread(target=drive, args=(trace, f"http://127.0.0.1:{port}", model_path.name, done),
                              daemon=True)
    client.start()   # before the profile is set: the client's own calls are not traced
    engine_in_a_thread()
    threading.setprofile(trace.profile)
    sys.setprofile(trace.profile)
    trace.phase = "background"
    try:
        code = main(["serve", "--model-path", str(model_path), "--port", str(port), "--num-threads", "1",
                     "--log-level", "warning"])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if code == 0:   # else the server never came up and the client still waits for it
        client.join()
    lines = done.get("lines", [])
    if code != 0 or done.get("status") != 200 or lines[-1:] != ["data: [DONE]"]:
        raise SystemExit(f"the request failed: exit {code}, status {done.get('status')}, {lines[-3:]}")
    return trace


def build_model(folder: pathlib.Path) -> pathlib.Path:
    from radixserve.tokenizer.tokenizer import Tokenizer
    from radixserve.weights.paths import resolve_model_path
    from tests.conftest import build_tiny_api_model

    return build_tiny_api_model(folder, Tokenizer.load(str(resolve_model_path(None))).hf)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print Trace.result() as one JSON line")
    p.add_argument("--model-path", type=pathlib.Path, help="a tiny model folder (default: build one)")
    p.add_argument("--functions", action="store_true", help="also list the functions called in each module")
    args = p.parse_args()
    os.environ.setdefault("RADIXSERVE_SINGLE_ROW_PATH", "split")   # no timing probe at start-up
    from radixserve.bench.launch import free_port

    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp:
        model_path = args.model_path or build_model(pathlib.Path(tmp) / "tiny")
        found = run(model_path, free_port()).result()
    if args.json:
        print(json.dumps(found))
        return
    titles = {"modules": "modules (calls during the request)",
              "types": "request/token types (calls that took one)",
              "private_types": "not counted: types private to one module",
              "parts_and_acks": "not counted: a response schema's nested parts, acknowledgements"}
    for key, title in titles.items():
        print(f"{len(found[key])} {title}:")
        entries = [f"{name} {n}".replace(" ", "\0") for name, n in found[key].items()]
        print(textwrap.fill(", ".join(entries), 100, initial_indent="  ", subsequent_indent="  ").replace("\0", " "))
    if args.functions:
        for module, names in found["functions"].items():
            print(f"{module}: {', '.join(names)}")


if __name__ == "__main__":
    main()
