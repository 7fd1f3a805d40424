"""Offline runner throughput of the torch and triton attention backends on random-weight Llama shapes, against measured rooflines.

NOT YET RUN ON A GPU: written and smoke-tested on CPU only (`--device cpu --tiny`, which runs
the torch backend, and the triton one under TRITON_INTERPRET=1).

Run:  python benchmarks/gpu/throughput.py                     # 1B and 8B shapes, bf16, cuda
      python benchmarks/gpu/throughput.py --device cpu --tiny # seconds, a smoke test

No checkpoint, tokenizer or server: the model is built in memory from a Llama config with
random weights (N(0, 0.02); RMSNorm weights 1) and driven through ModelRunner.run with
hand-built lists of ScheduledSeq, greedy sampling included.

  decode   B sequences with `--context` cached tokens each take one token per step; tok/s =
           B * steps / time. Roofline (weights) = B / (weight bytes / copy bandwidth): every
           step reads all weights once. Roofline (+KV) adds the K/V bytes the step reads.
  prefill  `--prefill-seqs` prompts of `--context` tokens in one step; tok/s against
           matmul rate / (2 * matmul parameters) (attention FLOPs left out, so an upper bound).

Copy bandwidth: a device-to-device copy of 2 x 1 GiB, counting bytes read and written.
Matmul rate: an 8192^3 bf16 product (fp32 on CPU). Each is the median of timed repeats.
Results print as a table and, when $OUT is set, go to $OUT/throughput.json too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from radixserve.engine.runner_api import ScheduledSeq  # noqa: E402
from radixserve.engine_config import EngineConfig  # noqa: E402
from radixserve.models.model_config import ModelConfig  # noqa: E402
from radixserve.models.registry import model_class  # noqa: E402
from radixserve.runner.attention.base import create_backend  # noqa: E402
from radixserve.runner.model_runner import ModelRunner  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

SHAPES = {  # Llama 3.2 1B and Llama 3.1 8B shapes; "tiny" for smoke tests
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, 10)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n product in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, device, 10)


def build_runner(shape: str, device: torch.device, dtype: str, max_total_tokens: int) -> ModelRunner:
    """A ModelRunner over a random-weight Llama of `shape`, built on `device` (no checkpoint)."""
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5, eos_token_id=2)
    mc = ModelConfig.from_hf(cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(mc)(mc)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.02)
    config = EngineConfig(model_path="(random)", dtype=dtype, device=str(device), page_size=16,
                          max_total_tokens=max_total_tokens, attention_backend="torch")
    return ModelRunner(model, mc, config)


def matmul_params(mc: ModelConfig) -> int:
    """Parameters multiplied per token: all linear layers and the LM head (not the embedding lookup)."""
    per_layer = mc.hidden_size * (mc.q_size + 2 * mc.num_kv_heads * mc.head_dim) + mc.q_size * mc.hidden_size \
        + 3 * mc.hidden_size * mc.intermediate_size
    return mc.num_layers * per_layer + mc.vocab_size * mc.hidden_size


def sequences(runner: ModelRunner, num: int, context: int, first_page: int = 0) -> list[ScheduledSeq]:
    """`num` prefill sequences of `context` random tokens, each owning distinct pages."""
    pages_each = -(-(context + 64) // runner.page_size)
    assert (first_page + num) * pages_each <= runner.num_pages, "KV cache too small for this run"
    gen = torch.Generator().manual_seed(num)
    out = []
    for i in range(num):
        ids = torch.randint(3, runner.vocab_size, (context,), generator=gen).tolist()
        pages = list(range((first_page + i) * pages_each, (first_page + i + 1) * pages_each))
        out.append(ScheduledSeq(f"r{i}", ids, 0, pages, True, GREEDY, i, ids, [], 0, None))
    return out


def prefill_all(runner: ModelRunner, seqs: list[ScheduledSeq], step_tokens: int) -> list[int]:
    """Prefill `seqs` a few at a time (at most ~step_tokens a step); returns each first token."""
    per_step = max(1, step_tokens // len(seqs[0].input_ids))
    tokens = []
    for i in range(0, len(seqs), per_step):
        tokens += [r.token_ids[-1] for r in runner.run(seqs[i:i + per_step])]
    return tokens


def decode_steps(runner: ModelRunner, seqs: list[ScheduledSeq], last: list[int], steps: int) -> None:
    """`steps` decode steps of all `seqs`, feeding back each sampled token."""
    outputs = [[t] for t in last]
    for _ in range(steps):
        batch = [ScheduledSeq(s.request_id, [o[-1]], len(s.input_ids) + len(o) - 1, s.page_ids, True, GREEDY,
                              s.seed, s.prompt_ids, list(o), 0, None) for s, o in zip(seqs, outputs)]
        for o, r in zip(outputs, runner.run(batch)):
            o.append(r.token_ids[-1])


def bench_model(shape: str, args, device: torch.device, bw: float, flops: float) -> list[dict]:
    max_batch = max(args.batches)
    pages_each = -(-(args.context + 64) // 16)
    runner = build_runner(shape, device, args.dtype, max(max_batch, args.prefill_seqs) * pages_each * 16)
    mc = runner.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token_bytes = runner.kv.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.kv.dtype)
    rows = []
    for backend in args.backends:
        runner.backend = create_backend(backend, runner.kv, device)
        seqs = sequences(runner, args.prefill_seqs, args.context)
        prefill_all(runner, seqs, 1 << 30)                                    # warm-up (and compile)
        sec = timed(lambda: prefill_all(runner, seqs, 1 << 30), device, args.repeats)
        tok = args.prefill_seqs * args.context
        roof = flops / (2 * matmul_params(mc))
        rows.append(dict(model=shape, backend=backend, phase="prefill", batch=args.prefill_seqs,
                         tokens=args.context, tok_s=tok / sec, roofline_tok_s=roof, roofline_kv_tok_s=None))
        for batch in args.batches:
            seqs = sequences(runner, batch, args.context)
            last = prefill_all(runner, seqs, args.prefill_step_tokens)
            sec = timed(lambda: decode_steps(runner, seqs, last, args.decode_steps), device, 1)
            kv_bytes = batch * (args.context + args.decode_steps // 2) * kv_token_bytes
            rows.append(dict(model=shape, backend=backend, phase="decode", batch=batch, tokens=args.context,
                             tok_s=batch * args.decode_steps / sec, roofline_tok_s=batch * bw / weight_bytes,
                             roofline_kv_tok_s=batch * bw / (weight_bytes + kv_bytes)))
        print(f"  {shape} {backend}: done", flush=True)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'model':>5} {'backend':>7} {'phase':>7} {'batch':>5} {'ctx':>5} {'tok/s':>10} " \
           f"{'roofline':>10} {'% roof':>6} {'roof+KV':>10} {'% +KV':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        kv = r["roofline_kv_tok_s"]
        print(f"{r['model']:>5} {r['backend']:>7} {r['phase']:>7} {r['batch']:>5} {r['tokens']:>5} "
              f"{r['tok_s']:>10.1f} {r['roofline_tok_s']:>10.1f} {100 * r['tok_s'] / r['roofline_tok_s']:>6.1f} "
              + (f"{kv:>10.1f} {100 * r['tok_s'] / kv:>6.1f}" if kv else f"{'':>10} {'':>6}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, small sizes: a smoke test in seconds")
    parser.add_argument("--models", default="1B,8B")
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence before decoding")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-step-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    args = parser.parse_args()
    assert args.decode_steps <= 64, "sequences() leaves 64 tokens of pages for decoding"
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.tiny:
        args.models, args.batches, args.context, args.decode_steps = "tiny", "1,4", 40, 3
        args.prefill_seqs, args.repeats = 2, 1
    args.batches = [int(b) for b in args.batches.split(",")]
    args.backends = args.backends.split(",")
    torch_dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth(device, (64 << 20) if args.tiny else (1 << 30))
    flops = matmul_rate(device, torch_dtype, 512 if args.tiny else 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: copy {bw / 1e9:.1f} GB/s, {args.dtype} matmul {flops / 1e12:.3g} TFLOP/s, "
          f"torch {torch.__version__}", flush=True)
    rows = []
    for shape in args.models.split(","):
        rows += bench_model(shape, args, device, bw, flops)
    print_table(rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "throughput.json"), "w") as f:
            json.dump({"device": name, "copy_bytes_s": bw, "matmul_flop_s": flops, "dtype": args.dtype,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
