"""DSA sparse attention vs dense MLA at long context: one decode step's attention time at 4k and 32k context, one run.

    PYTHONPATH=. python benchmarks/dsa_decode.py [--contexts 4096,32768] [--index-topk 256] [--repeats 20]

A GLM-5-shaped tiny glm_moe_dsa checkpoint (random weights; GLM-5's attention widths: kv_lora_rank 512,
qk_rope_head_dim 64, 32 indexer heads x 128, only 8 attention heads and 1 layer) is saved and loaded into a runner
whose KV cache, for one sequence of each context length, is filled with random latents and index keys (no prefill).
Per context it times, median of --repeats: the decode row's latent attention over the indexer's selection
(SparseStepAttention.attend_selected: index_topk rows), the same row through the dense backend (every position),
the indexer's scoring and top-k (select_topk, O(context)), and the whole decode step (model forward). Prints the
32k/4k ratio of each and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.models.dsa import select_topk
from radixserve.runner.attention.sparse import INDEX_KEYS
from radixserve.runner.batch import build_step
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams

GLM5_SHAPED = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                   kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4,
                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, index_n_heads=32,
                   index_head_dim=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_theta=1e6)


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure(runner: ModelRunner, context: int, repeats: int) -> dict[str, float]:
    kv, mc = runner.kv, runner.model_config
    pages = list(range(-(-context // kv.page_size)))
    slots = torch.arange(context)
    gen = torch.Generator().manual_seed(context)
    kv.write(0, slots, *(2 * [torch.randn(context, 1, kv.head_dim, generator=gen)]))
    kv.write_side(INDEX_KEYS, 0, slots, torch.randn(context, mc.dsa.index_head_dim, generator=gen))
    seq = ScheduledSeq("b", [5], context - 1, pages, True, SamplingParams(temperature=0, max_tokens=1), 7, [5], [],
                       0, None)
    step = build_step([seq], kv.page_size, runner.device)
    attn = runner.backend.prepare(step)
    q = torch.randn(1, mc.num_heads, kv.head_dim, generator=gen)
    k = torch.randn(1, 1, kv.head_dim, generator=gen)
    keys = attn.index_keys(0, 0)
    q_idx = torch.randn(1, mc.dsa.index_n_heads, mc.dsa.index_head_dim, generator=gen)
    weights = torch.randn(1, mc.dsa.index_n_heads, generator=gen)
    chosen = [select_topk(q_idx, weights, keys, context - 1, mc.dsa.index_topk)]
    return {"sparse attention": median_s(lambda: attn.attend_selected(0, q, k, chosen), repeats),
            "dense attention": median_s(lambda: attn.dense(0, q, k, k), repeats),
            "indexer scoring + top-k": median_s(
                lambda: select_topk(q_idx, weights, attn.index_keys(0, 0), context - 1, mc.dsa.index_topk), repeats),
            "decode step (forward)": median_s(
                lambda: runner.model(step.input_ids, step.positions, runner.backend.prepare(step), None), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--index-topk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import transformers

    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        config = transformers.GlmMoeDsaConfig(**GLM5_SHAPED, index_topk=args.index_topk,
                                              max_position_embeddings=max(contexts) + 16)
        transformers.GlmMoeDsaForCausalLM(config).save_pretrained(folder)
        runner = ModelRunner.from_config(EngineConfig(model_path=folder, page_size=64,
                                                      max_total_tokens=max(contexts) + 64))
        results = {c: measure(runner, c, args.repeats) for c in contexts}
    print(f"index_topk {args.index_topk}, {torch.get_num_threads()} threads, median of {args.repeats}")
    first, last = contexts[0], contexts[-1]
    for name in results[first]:
        row = "  ".join(f"{c}: {results[c][name] * 1e3:8.3f} ms" for c in contexts)
        print(f"{name:26s} {row}  ratio {last}/{first}: {results[last][name] / results[first][name]:.2f}x")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
