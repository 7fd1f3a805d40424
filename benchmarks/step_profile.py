"""Where a decode step's time goes: the engine's step split into scheduling, step-tensor
building, attention metadata, the model's forward, sampling and the engine's update, at
batch 1 and batch 64, in one process with the default model (or --model-path).

    PYTHONPATH=. python benchmarks/step_profile.py                  # batch 1 and 64
    PYTHONPATH=. python benchmarks/step_profile.py --batch-sizes 1 --py-spy /tmp/b1.svg
    PYTHONPATH=. python benchmarks/step_profile.py --batch-sizes 1 --prompt-len 256 \
        --quantization int4 --quantized-max-tokens 12                           # a quantized GGUF

Each phase is timed by wrapping the method that does it (time.perf_counter, no profiler
overhead inside the forward). "outside the forward" = the whole `Engine.step()` minus the
model's `forward` call: the issue's per-step overhead (issue 17 item 2). Requests are decoding
only (prompts prefilled before timing starts, `ignore_eos`, enough `max_tokens` that none
finishes while timed). `--py-spy FILE` also records a flame graph of the timed steps
(`pip install py-spy` first; the package does not depend on it).

`--ablate int4,int8,attention` replaces those kernels by zeros of the right shape and dtype
(the quantized int4 / int8 matmuls, the int8-screened LM head included, and decode attention),
so the step's time without them is what the rest costs: small ops, Python, scheduling. The
tokens are meaningless then; the timing is not, since every request decodes to its length.
    PYTHONPATH=. python benchmarks/step_profile.py --batch-sizes 1 --prompt-len 256 \
        --quantization int4 --quantized-max-tokens 12 --ablate int4,int8,attention
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from radixserve.cli import build_runner
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.sampling_params import SamplingParams

PHASES = {   # phase -> (object path from the engine, method name)
    "schedule": ("scheduler", "schedule"),
    "runner.run": ("runner", "run"),
    "forward": ("runner.model", "forward"),
    "attn.prepare": ("runner.backend", "prepare"),
    "sample": ("runner.sampler", "sample"),
    "update": ("", "_update"),
}


def wrap(engine: Engine, times: dict[str, list[float]]) -> None:
    """Time every PHASES method of `engine` into `times` (seconds per call)."""
    for phase, (path, name) in PHASES.items():
        obj = engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        inner = getattr(obj, name)

        def timed(*args, _inner=inner, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                times[_phase].append(time.perf_counter() - start)
        setattr(obj, name, timed)


def ablate(kernels: list[str]) -> None:
    """Replace each named kernel by zeros of its output's shape and dtype (see the docstring)."""
    from radixserve.layers import quant_linear
    from radixserve.runner.attention import decode_kernel, decode_mirror, torch_backend

    for kernel in kernels:
        if kernel in ("int4", "int8"):
            cls = quant_linear.Int4Matmul if kernel == "int4" else quant_linear.Int8Matmul
            rows = (lambda m: m.scales_zeros.shape[1]) if kernel == "int4" else (lambda m: m.values.shape[0])
            cls.__call__ = lambda self, x, cast_back=True, _rows=rows: torch.zeros(
                x.shape[0], _rows(self), dtype=x.dtype if cast_back else quant_linear.ACTIVATION_DTYPE)
        elif kernel == "attention":
            decode_mirror.decode_attention = torch_backend.decode_attention = \
                decode_mirror.decode_attention_lens = decode_kernel.decode_attention_paged = \
                lambda q, *_args: torch.zeros_like(q)   # (q, k, v, mask | lens | page table and lens)
            decode_mirror.cascade_attend = lambda _plan, q, *_args: torch.zeros_like(q)
        else:
            raise SystemExit(f"--ablate: unknown kernel {kernel!r} (int4, int8, attention)")


def profile(engine: Engine, batch: int, steps: int, prompt_len: int, py_spy: str | None) -> dict:
    """Decode `steps` steps with `batch` running requests; per-phase medians in ms."""
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(f"r{batch}-{i}", prompt, SamplingParams(
            max_tokens=steps + 16 + batch, temperature=0.0, ignore_eos=True))   # early ones decode while others prefill
    while any(r.is_prefilling for r in engine.requests.values()) or len(engine.scheduler.running) < batch:
        engine.step()
    for _ in range(3):   # warm the decode path
        engine.step()
    times: dict[str, list[float]] = defaultdict(list)
    spy = None
    if py_spy:
        spy = subprocess.Popen(["py-spy", "record", "-o", py_spy, "-r", "200", "--nonblocking",
                                "-p", str(os.getpid())], stdout=subprocess.DEVNULL)
        time.sleep(1.0)
    wrap(engine, times)
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        times["step"].append(time.perf_counter() - start)
        assert len(outs) == batch, "a request finished or stalled while timed"
    if spy is not None:
        spy.terminate()
        spy.wait()
    for rid in list(engine.requests):
        engine.abort(rid)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    ms["outside forward"] = 1000 * statistics.median(s - f for s, f in zip(times["step"], times["forward"]))
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quantization", default="none", help="none | int8 | int4 | int4-int8 | int4-fp32 | auto (EngineConfig)")
    ap.add_argument("--quantized-max-tokens", type=int, default=None)
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--py-spy", default=None, help="flame graph of the timed steps (svg path)")
    ap.add_argument("--ablate", default="", help="kernels to replace by zeros: int4,int8,attention")
    args = ap.parse_args()
    config = EngineConfig(model_path=args.model_path, num_threads=args.num_threads,
                          max_running_requests=256, quantization=args.quantization,
                          quantized_max_tokens=args.quantized_max_tokens,
                          enable_deterministic_inference=args.enable_deterministic_inference,
                          compile="off")   # the phase timers wrap the forward a compiled graph would trace
    engine = Engine(config, build_runner(config))
    ablate([k for k in args.ablate.split(",") if k])
    print(f"load {os.getloadavg()[0]:.2f} at start; threads {args.num_threads or os.cpu_count()}")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        spy = args.py_spy.replace(".svg", f"_b{batch}.svg") if args.py_spy else None
        ms = profile(engine, batch, args.steps, args.prompt_len, spy)
        rows.append((batch, ms))
    names = ["step", "forward", "outside forward", "schedule", "runner.run", "attn.prepare",
             "sample", "update"]
    print(f"{'batch':>5} " + " ".join(f"{n:>15}" for n in names) + "   share outside")
    for batch, ms in rows:
        print(f"{batch:>5} " + " ".join(f"{ms.get(n, 0):>15.2f}" for n in names)
              + f"   {100 * ms['outside forward'] / ms['step']:.1f} %")
    print(f"load {os.getloadavg()[0]:.2f} at end (ms per step, medians over {args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
