"""A quantized model's small-step LM head (layers/q8_fp32.py or screened_head.py) against the fp32 head, in one run.

    PYTHONPATH=. python benchmarks/lm_head.py [--rows 1,2,4,8,16] [--batches 1,4] [--quantization int4]

1. The default model's head alone (49152 x 576, random weights): median ms per call of the
   fp32 paths (split bmm at M = 1, oneDNN-packed above), of the screened head and of the q8_fp32
   head (the weight a Q8_0 grid), for each number of logit rows M, alternating the three.
2. The engine (default model, `--quantization`, `--quantized-max-tokens 12`): decode steps of
   `--batches` running requests with the small-step head switched on and off every 6 steps, median ms
   per step of each. The ratio is fp32 head time / screened head time.
3. Quality: the hidden states the head saw while the engine sampled 48 tokens for each parity
   prompt (temperature 0.8, seeded), through the fp32 head and the screened one: greedy
   agreement, the screened rank of fp32's argmax, |delta logprob| of fp32's argmax, and the
   probability fp32 puts outside the recomputed top.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from radixserve.cli import build_runner
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.layers.linear import Linear
from radixserve.layers.screened_head import ScreenedHead
from radixserve.models.llama import HEAD_EXACT_TOP
from radixserve.sampling_params import SamplingParams


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def head_alone(rows: list[int], reps: int) -> None:
    fp32, screened, q8 = Linear(576, 49152), Linear(576, 49152), Linear(576, 49152)
    gen = torch.Generator().manual_seed(0)   # a Q8_0 grid, as the default model's head: w = d * q
    codes = torch.randint(-127, 128, (49152, 576), generator=gen, dtype=torch.int8)
    codes[:, ::32] = 127   # ggml's quantizer puts a +-127 in every block
    d = (torch.rand(49152, 18, generator=gen) * 2e-4).half().float()
    fp32.weight.data.copy_((codes.float().view(49152, 18, 32) * d[..., None]).view(49152, 576))
    screened.weight = q8.weight = fp32.weight
    for head in (fp32, screened, q8):
        head.prepare()
    if not screened.enable_screened_head(max(rows), HEAD_EXACT_TOP) or not q8.enable_q8_head(max(rows)):
        sys.exit("no int8 weight kernel or no q8_fp32 vector path on this CPU")
    print(f"\n## head alone, 49152 x 576, top {HEAD_EXACT_TOP} recomputed (load {os.getloadavg()[0]:.2f})\n")
    print("| rows | fp32 ms | screened ms | q8_fp32 ms | fp32 / q8_fp32 |\n|---:|---:|---:|---:|---:|")
    for m in rows:
        x = torch.randn(m, 576)
        times: list[list[float]] = [[], [], []]
        for _ in range(reps):
            for i, head in enumerate((fp32, screened, q8)):
                times[i].append(median_ms(lambda: head(x), 3))
        a_ms, b_ms, c_ms = (statistics.median(t) for t in times)
        print(f"| {m} | {a_ms:.2f} | {b_ms:.2f} | {c_ms:.2f} | {a_ms / c_ms:.2f}x |")


def engine_steps(engine: Engine, batches: list[int], rounds: int) -> None:
    head = engine.runner.model.lm_head
    screen = head._small_head
    if screen is None:
        sys.exit("the head has no small-step path (only quantized models have one)")
    print("\n## engine decode steps, --quantized-max-tokens 12\n")
    print("| batch | fp32 head ms/step | small-step head ms/step | fp32 / small | load |\n|---:|---:|---:|---:|---:|")
    for batch in batches:
        for i in range(batch):
            prompt = [(i * 7919 + j * 31) % 1000 + 10 for j in range(64)]
            engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(
                max_tokens=rounds * 14 + 32, temperature=0.0, ignore_eos=True))
        while len(engine.scheduler.running) < batch or any(r.is_prefilling for r in engine.requests.values()):
            engine.step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (True, False):
                head._small_head = screen if on else None
                engine.step()                               # one untimed step after each switch
                for _ in range(6):
                    start = time.perf_counter()
                    engine.step()
                    times[on].append(time.perf_counter() - start)
        head._small_head = screen
        for rid in list(engine.requests):
            engine.abort(rid)
        on, off = (1000 * statistics.median(times[k]) for k in (True, False))
        print(f"| {batch} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {os.getloadavg()[0]:.2f} |")


def quality(engine: Engine) -> None:
    from radixserve.tokenizer.tokenizer import Tokenizer
    from radixserve.weights.paths import resolve_model_path
    from tests.model.parity import PARITY_TEXTS

    tokenizer = Tokenizer.load(resolve_model_path(None, need_tokenizer=True))
    head = engine.runner.model.lm_head
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach().clone()))
    for i, text in enumerate(PARITY_TEXTS):
        engine.add_request(f"q{i}", tokenizer.apply_chat_template([{"role": "user", "content": text}]), SamplingParams(
            max_tokens=48, temperature=0.8, seed=i, ignore_eos=True))
    while engine.requests:
        engine.step()
    hook.remove()
    x = torch.cat(seen)                                               # (N, 576) hidden states
    ref = x @ head.weight.data.t()                                   # fp32 logits
    got = ScreenedHead(head.weight.data, HEAD_EXACT_TOP)(x, head.weight.data, None)
    best = ref.argmax(-1)
    rank = (got > got.gather(1, best[:, None])).sum(1)
    dlp = (torch.log_softmax(got, -1) - torch.log_softmax(ref, -1)).gather(1, best[:, None]).abs()
    top = got.topk(HEAD_EXACT_TOP, -1).indices
    outside = 1 - torch.softmax(ref, -1).gather(1, top).sum(1)
    print(f"\n## quality on {x.shape[0]} hidden states of the parity prompts (top {HEAD_EXACT_TOP})\n")
    print(f"greedy agreement {float((got.argmax(-1) == best).float().mean()):.2%}; screened rank of fp32's "
          f"argmax: max {int(rank.max())}; |delta logprob| of fp32's argmax: mean {float(dlp.mean()):.2e}, "
          f"max {float(dlp.max()):.2e}; fp32 probability outside the recomputed top: mean "
          f"{float(outside.mean()):.3f}, max {float(outside.max()):.3f}; tail |delta logit| mean "
          f"{float((got - ref).abs().mean()):.3f}, max {float((got - ref).abs().max()):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--quantization", default="int4", choices=("int4", "int8", "auto"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    head_alone([int(r) for r in args.rows.split(",")], args.reps)
    config = EngineConfig(quantization=args.quantization, quantized_max_tokens=12, max_running_requests=256)
    engine = Engine(config, build_runner(config))
    engine_steps(engine, [int(b) for b in args.batches.split(",")], args.rounds)
    quality(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
