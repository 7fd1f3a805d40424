"""The decode forward compiled by torch.compile (Inductor, C++), one graph per batch-size bucket, cached on disk
(`--compile auto|on|off`, docs/runner.md "Compiled decode"). Prefill, mixed and larger steps stay eager."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import torch

from radixserve.layers import opaque_attention
from radixserve.layers.attention import Attention
from radixserve.config import cache_root
from radixserve.layers.row_path import cpu_identity
from radixserve.runner.batch import StepBatch

logger = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True, "fx_graph_cache": True}
# Dynamo keeps one cache entry per (runner, bucket) on the shared `_forward` code; its default limit of 8 would send
# later buckets (or a second runner in one process) to eager silently.
RECOMPILE_LIMIT = 256


def buckets(max_bs: int) -> list[int]:
    """Decode batch sizes compiled for `--torch-compile-max-bs`: powers of two below it, then it (a step pads up)."""
    sizes = [1]
    while sizes[-1] * 2 < max_bs:
        sizes.append(sizes[-1] * 2)
    return sizes + ([max_bs] if max_bs > sizes[-1] else [])


def graph_key(what: dict) -> str:
    """A short hash of everything that changes a compiled graph (C61): `what` plus torch's version and the CPU."""
    cpu = cpu_identity()
    full = {**what, "torch": torch.__version__, "cpu": cpu, "threads": torch.get_num_threads(),
            "inductor": INDUCTOR_OPTIONS}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:24]


def compiler_missing() -> str | None:
    """Why Inductor cannot compile C++ here (None: a compiler is on PATH or in $CXX)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return None if shutil.which(cxx) else f"$CXX={cxx} not found"
    if any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return None
    return "no C++ compiler (g++, clang++, c++) on PATH"


def _tqdm_thread_lock() -> None:
    """Give tqdm (whose bar torch.fx's interpreter opens while tracing) a thread lock before it makes a
    multiprocessing one: the engine process ends with os._exit (engine/loop.py), which skips the finalizer that
    unlinks such a semaphore, and the resource tracker then warns of a leak at shutdown."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())


@contextlib.contextmanager
def _inductor_cache(folder: pathlib.Path) -> Iterator[None]:
    """Inductor's on-disk caches go to `folder` while compiling (its env var is read on each cache access)."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


class DecodeGraphs:
    """Compiled forward of `model` (a LlamaForCausalLM) for steps of up to `max_bs` tokens, every row a logit row.

    `run(step, attn)` -> (logits (T, V) fp32,) or, with `hidden` (an EAGLE / NextN draft reads it), (logits, the
    final hidden state (T, hidden_size)); None for a step it does not take (eager runs it). `graphs` counts the
    graphs Inductor compiled, `recompiles` those compiled after warm-up (0 in steady state, C63).

    After warm-up a bucket's graph is called directly, without Dynamo's frame entry, guards and argument gathering
    (1.6-1.9 ms a batch-1 step, docs/benchmarks.md): every argument Dynamo passes is fixed for the bucket (the model's
    tensors and the bucket's own input buffers, which `run` fills), so warm-up records them once. A bucket whose
    recorded arguments or output do not check out keeps the Dynamo call."""

    def __init__(self, model: torch.nn.Module, max_bs: int, key: str, device: torch.device,
                 root: pathlib.Path | None = None, hidden: bool = False):
        self.model = model
        self.hidden = hidden
        self.buckets = buckets(max_bs)
        self.folder = (root or cache_root() / "compile") / key
        self.device = device
        self.graphs = 0
        self.recompiles = 0
        self.steps = 0
        self.verify_steps = 0   # of `steps`: those verifying drafts (some sequence has more than one row)
        self.warm = False
        self._recording: int | None = None
        # bucket -> (Inductor's compiled function, the arguments Dynamo called it with)
        self._direct: dict[int, tuple[Callable, tuple]] = {}
        self._opaque = opaque_attention.OpaqueAttention()
        self._inputs = {b: (torch.zeros(b, dtype=torch.int64, device=device),
                            torch.zeros(b, dtype=torch.int64, device=device)) for b in self.buckets}
        for name in ("recompile_limit", "accumulated_recompile_limit"):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
        self._compiled = torch.compile(self._forward, backend=self._backend, dynamic=False)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.hidden:
            return (self.model(input_ids, positions, self._opaque),)
        h = self.model.final_hidden(input_ids, positions, self._opaque)
        return self.model.lm_head(h).float(), h

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        self.graphs += 1
        if self.warm:
            self.recompiles += 1
            logger.warning("compiled decode: recompiling after warm-up (%d so far)", self.recompiles)
        compiled = compile_fx(gm, example_inputs, config_patches=INDUCTOR_OPTIONS)

        def call(*args: object) -> object:
            if self._recording is not None:
                self._direct.setdefault(self._recording, (compiled, args))
            return compiled(*args)
        return call

    def _check_direct(self, b: int) -> None:
        """Keep bucket b's recorded call only if it reads the bucket's input buffers and returns what Dynamo does."""
        fn, args = self._direct.pop(b, (None, ()))
        ids, pos = self._inputs[b]
        if sum(a is ids for a in args) != 1 or sum(a is pos for a in args) != 1:
            logger.info("compiled decode: batch %d keeps the Dynamo call (its inputs are not the buffers)", b)
            return
        ids.copy_(torch.arange(b, device=ids.device) + 1)
        pos.copy_(torch.arange(b, device=pos.device))
        expected, got = self._compiled(ids, pos), fn(*args)
        if not (isinstance(got, (list, tuple)) and len(got) == len(expected)
                and all(torch.equal(g, e) for g, e in zip(got, expected))):
            logger.info("compiled decode: batch %d keeps the Dynamo call (its output differs)", b)
            return
        self._direct[b] = (fn, args)

    def warm_up(self) -> None:
        """Compile (or load from the disk cache) every bucket, one log line each; raises what Inductor raises.
        Attention is stubbed (zeros) here: warm-up writes no KV."""
        self.folder.mkdir(parents=True, exist_ok=True)
        _tqdm_thread_lock()
        logger.info("compiled decode: building batch sizes %s in %s (minutes on a cold cache, seconds from it)",
                    ", ".join(map(str, self.buckets)), self.folder)

        def stub(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return q.new_zeros(q.shape[0], q.shape[1] * v.shape[2])
        with _inductor_cache(self.folder), torch.inference_mode():
            for b in self.buckets:
                start, before = time.perf_counter(), self.graphs
                self._recording = b
                try:
                    with opaque_attention.bound(stub, b):
                        self._compiled(*self._inputs[b])
                finally:
                    self._recording = None
                if self.graphs == before:
                    raise RuntimeError(f"batch {b}: torch.compile ran eagerly (no graph compiled)")
                with opaque_attention.bound(stub, b):
                    self._check_direct(b)
                logger.info("compiled decode: batch %d ready in %.1f s (%d graph(s))", b,
                            time.perf_counter() - start, self.graphs - before)
        self.warm = True

    def bucket(self, step: StepBatch) -> int | None:
        """The bucket a step of T <= max_bs tokens whose every row is a logit row pads to (decodes, and drafts being
        verified: attention is the bound backend's, whatever the step's shape); None for any other step."""
        n = step.num_tokens
        if n > self.buckets[-1] or len(step.logit_rows) != n:   # rows are distinct and in order: all of them
            return None
        if any(p is not None for p in step.prompt_rows):
            return None
        return next(b for b in self.buckets if b >= n)

    def run(self, step: StepBatch, attn: Attention) -> tuple[torch.Tensor, ...] | None:
        """The outputs (class docstring) of a step `bucket` takes, through its bucket's graph, `attn` bound, each cut
        to the step's T rows; None: a step it does not take."""
        b = self.bucket(step)
        if b is None:
            return None
        n = step.num_tokens
        ids, pos = self._inputs[b]
        ids[:n].copy_(step.input_ids)
        pos[:n].copy_(step.positions)
        direct = self._direct.get(b)
        with opaque_attention.bound(attn, n):
            if direct is not None:
                out = direct[0](*direct[1])
            else:
                with _inductor_cache(self.folder):
                    out = self._compiled(ids, pos)
        self.steps += 1
        self.verify_steps += len(step.query_lens) != n
        return tuple(t[:n] for t in out)

    def info(self) -> dict:
        return {"buckets": self.buckets, "graphs": self.graphs, "recompiles": self.recompiles, "steps": self.steps,
                "verify_steps": self.verify_steps,
                "direct": sorted(self._direct), "cache": str(self.folder)}
