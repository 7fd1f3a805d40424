"""GLM-5 race soak: requests whose prefixes keep moving between the device and host KV tiers, every layer's load
delayed, every output compared with a tier-off reference; 0 differing outputs expected with the readiness wait on.

    PYTHONPATH=. python benchmarks/dsa_race_soak.py [--num-requests 10000] [--concurrency 16] [--model-path DIR]
        [--latency-ms 1] [--jitter-ms 1] [--skip-wait none|side|all] [--seed 0]

Without --model-path a tiny glm_moe_dsa (6 layers, IndexShare freq 4, index_topk 8, 16 indexer heads, fp32) is
built. --num-unique prompts (shared 96-token session prefixes plus 0-24 own tokens) are answered once, greedy, by an
engine without the host tier (the reference). Then an engine with the host tier and a 24-page device pool (so prefix
pages are evicted to host and loaded back all the time) serves --num-requests drawn from them, --concurrency at a
time, with `hicache.h2d.layer` armed (each layer of each load waits U(latency - jitter, latency + jitter) ms) and
its `skip_wait`. An output differs when a token differs at a position where the reference's top-2 logprob gap is
>= 1e-3 (radixserve.bench.check's tie gap). Exit 0 only with 0 differing outputs; --skip-wait side (index keys read
before their load: GLM-5's bug) is expected to give differing outputs.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from radixserve.bench.check import TIE_GAP  # noqa: E402
from radixserve.chaos.engine_faults import EngineFaults  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine_config import EngineConfig  # noqa: E402
from radixserve.runner.model_runner import ModelRunner  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, first_k_dense_replace=1, index_n_heads=16, index_head_dim=32, index_topk=8,
            index_topk_freq=4, rope_theta=1e6, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)


def build_tiny(folder: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**TINY))
    with torch.no_grad():    # transformers zero-initialises the router: every expert would tie
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn_like(tensor) * 0.5)
    model.save_pretrained(folder)
    return folder


def engine(model_path: str, faults: EngineFaults | None = None, **cfg) -> Engine:
    config = EngineConfig(model_path=model_path, page_size=16, chunked_prefill_size=64, quantization="none", **cfg)
    return Engine(config, ModelRunner.from_config(config), hooks=[faults] if faults else [])


def serve(eng: Engine, prompts: list[list[int]], order: list[int], concurrency: int) -> dict[int, list]:
    """Request k serves prompts[order[k]], at most `concurrency` in flight; {k: [TokenLogprob]}."""
    out: dict[int, list] = {k: [] for k in range(len(order))}
    pending, live = list(range(len(order)))[::-1], 0
    while pending or eng.has_unfinished():
        while pending and live < concurrency:
            k = pending.pop()
            eng.add_request(f"q{k}", prompts[order[k]], PARAMS)
            live += 1
        for o in eng.step():
            out[int(o.request_id[1:])] += o.new_logprobs
            live -= o.finished
    return out


def differs(ref: list, got: list) -> bool:
    for r, g in zip(ref, got):
        if r.token_id != g.token_id:
            gap = r.top[0][1] - r.top[1][1] if len(r.top) > 1 else float("inf")
            return gap >= TIE_GAP
    return False


def soak(model_path: str, num_requests: int, concurrency: int = 16, latency_ms: float = 1.0,
         jitter_ms: float = 1.0, skip_wait: str = "none", num_unique: int = 48, seed: int = 0) -> dict:
    """Run the soak; its counts: requests, differing, hicache loads, cached tokens from the host tier."""
    rng = random.Random(seed)
    sessions = [[rng.randrange(3, 500) for _ in range(96)] for _ in range(6)]
    prompts = [rng.choice(sessions) + [rng.randrange(3, 500) for _ in range(rng.randrange(25))]
               for _ in range(num_unique)]
    reference = serve(engine(model_path, max_total_tokens=4096), prompts, list(range(num_unique)), concurrency)
    faults = EngineFaults()
    tiered = engine(model_path, faults, max_total_tokens=24 * 16, enable_hierarchical_cache=True,
                    hicache_ratio=8.0)
    faults.fault("hicache.h2d.layer", latency_ms=latency_ms, jitter_ms=jitter_ms, skip_wait=skip_wait)
    order = [rng.randrange(num_unique) for _ in range(num_requests)]
    got = serve(tiered, prompts, order, concurrency)
    tiered.check_invariants()
    stats = tiered.stats()
    return {"requests": num_requests, "differing": sum(differs(reference[order[k]], got[k]) for k in got),
            "hicache_loads": stats["hicache_loads"], "cached_tokens_host": stats["num_cached_tokens_host"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model-path")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--jitter-ms", type=float, default=1.0)
    parser.add_argument("--skip-wait", default="none", choices=("none", "side", "all"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = soak(args.model_path or build_tiny(folder), args.num_requests, args.concurrency, args.latency_ms,
                      args.jitter_ms, args.skip_wait, seed=args.seed)
    print(f"{result} skip_wait={args.skip_wait} in {time.perf_counter() - start:.0f} s, "
          f"load average (1 min) {os.getloadavg()[0]:.2f}")
    sys.exit(0 if result["differing"] == 0 else 1)


if __name__ == "__main__":
    main()
