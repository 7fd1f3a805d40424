"""llama.cpp's own logits for given token ids, for quality comparisons (benchmarks/quantized.py --llama-cpp).

Uses the llama-cpp-python sources and the shared libraries that `benchmarks/peers/llama_cpp.py`
builds (the same llama.cpp as its llama-server), through the package's ctypes bindings: no
wheel is built. The bindings import `diskcache`; `ensure_bindings` installs it with pip (a
benchmark-only dependency, never the package's). llama.cpp computes with the GGUF's own
weights (Q4_1 decoder layers, Q8_0 embedding / head on the default model) and its own
quantized activations, so these logits are what llama.cpp would serve.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np

from benchmarks.peers.llama_cpp import build_llama_server


def ensure_bindings():
    """Import llama_cpp from the built sources (building llama-server first if needed)."""
    bin_dir = build_llama_server().parent
    source = bin_dir.parents[3]            # .../llama_cpp_python-X/vendor/llama.cpp/build/bin
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(bin_dir))
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))
    try:
        importlib.import_module("diskcache")
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "diskcache"], check=True)
    return importlib.import_module("llama_cpp")


class LlamaCppScorer:
    """One llama.cpp context over `gguf` (`threads` CPU threads, `n_ctx` positions)."""

    def __init__(self, gguf: str, threads: int | None = None, n_ctx: int = 2048):
        llama_cpp = ensure_bindings()
        self.llm = llama_cpp.Llama(model_path=gguf, logits_all=True, n_ctx=n_ctx, verbose=False,
                                   n_threads=threads or os.cpu_count() or 1)

    def teacher_forced(self, ids: list[int], start: int) -> tuple[list[int], list[float]]:
        """Evaluate `ids` in one pass; for each position p in [start, len(ids) - 1): the top-1
        next token and the log-probability of ids[p + 1] (natural log, fp64 log-softmax over
        llama.cpp's fp32 logits)."""
        self.llm.reset()
        self.llm.eval(ids)
        logits = np.asarray(self.llm.scores[start:len(ids) - 1], dtype=np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        targets = np.asarray(ids[start + 1:])
        return logits.argmax(-1).tolist(), logprobs[np.arange(len(targets)), targets].tolist()

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation of `prompt` (argmax of each step's logits, no sampler)."""
        self.llm.reset()
        self.llm.eval(prompt)
        out: list[int] = []
        for _ in range(num_tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            self.llm.eval([token])
        return out
