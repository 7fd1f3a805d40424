"""The routed-experts layer (models/moe.py) against transformers' own GLM-4.5 MoE block, same weights, same run.

Run:  python benchmarks/moe_layer.py [--tokens 64] [--experts 64] [--top-k 8] [--hidden 1024]
                                     [--moe-intermediate 512] [--repeats 30]
                                     [--dtype float32|bfloat16]

Builds `Glm4MoeMoE` (sigmoid router, 2 groups, a shared expert) with random weights, copies them
into radixserve's MoE, checks the outputs agree (max abs diff printed), then times the forwards
interleaved on the same (tokens, hidden) input in --dtype (bfloat16: both layers cast, as a
bf16 checkpoint serves; radixserve's router stays fp32 as the model's `prepare` keeps it):
transformers' experts both as `eager` (a loop over hit experts with F.linear) and as
`grouped_mm` (torch's grouped GEMM, what `from_pretrained` picks where torch has it), and
radixserve's. Prints medians, each ratio and
the 1-minute load average, then the memory-bandwidth roofline: the weight bytes one forward
must read (every expert the batch routes to, the shared expert, the router), the read
bandwidth measured here (benchmarks/roofline.py), the floor in ms they give, the largest
speed-up over each transformers variant that any implementation could reach on this machine,
and the fraction of the floor radixserve reaches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from roofline import bandwidth_gbs


def build(args):
    import transformers

    from radixserve.models.llama import LlamaMLP
    from radixserve.models.block_config import MoEConfig
    from radixserve.models.model_config import ModelConfig
    from radixserve.models.moe import MoE

    cfg = transformers.Glm4MoeConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                     moe_intermediate_size=args.moe_intermediate, n_routed_experts=args.experts,
                                     num_experts_per_tok=args.top_k, n_shared_experts=1, n_group=2, topk_group=1,
                                     routed_scaling_factor=2.5, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    hf = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
        hf.gate.e_score_correction_bias.uniform_(0, 0.1)
    moe_cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.moe_intermediate,
                        scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                        num_shared_experts=1, num_groups=2, topk_groups=1)
    mc = ModelConfig("glm4_moe", 16, args.hidden, 2 * args.hidden, 1, 8, 8, args.hidden // 8, 1e-5, 1e6,
                     64, False, moe=moe_cfg)
    ours = MoE(args.hidden, moe_cfg, LlamaMLP(mc, args.moe_intermediate)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.gate_up.copy_(hf.experts.gate_up_proj)
        ours.experts.down.copy_(hf.experts.down_proj)
        shared = hf.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
    hf.to(args.dtype)
    ours.to(args.dtype)
    with torch.no_grad():
        ours.gate.float()
    for module in ours.modules():
        if hasattr(module, "prepare"):   # oneDNN-packed weights, as the model runner does
            module.prepare()
    return hf, ours


def weight_bytes(ours, x: torch.Tensor) -> int:
    """Bytes of weights one forward of `ours` (radixserve's MoE) reads on input x (T, hidden):
    the gate-up and down matrices of each expert the batch routes to, once each, plus the
    shared experts and the router; activations are ignored (a few hundred KB here)."""
    _, ids = ours.gate(x)
    hit = torch.unique(ids).numel()
    experts = ours.experts
    per_expert = (experts.gate_up[0].numel() + experts.down[0].numel()) * experts.gate_up.element_size()
    rest = sum(p.numel() * p.element_size() for m in (ours.gate, ours.shared_experts) for p in m.parameters())
    return hit * per_expert + rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    hf, ours = build(args)
    x = torch.randn(args.tokens, args.hidden).to(args.dtype)
    def transformers_as(impl: str):
        def run():
            hf.experts.config._experts_implementation = impl
            return hf(x[None]).squeeze(0)
        return run

    runs = {"transformers eager": transformers_as("eager"), "transformers grouped_mm": transformers_as("grouped_mm"),
            "radixserve": lambda: ours(x)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        ref = ours(x)
        diffs = {name: (fn() - ref).abs().max().item() for name, fn in runs.items() if name != "radixserve"}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"MoE layer, {args.tokens} tokens, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"expert width {args.moe_intermediate}, {str(args.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads; "
          f"load {os.getloadavg()[0]:.2f}; max |diff| " + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
    for name in ("transformers eager", "transformers grouped_mm"):
        print(f"{name} {ms[name]:.2f} ms  radixserve {ms['radixserve']:.2f} ms  speed-up {ms[name] / ms['radixserve']:.2f}x")
    with torch.inference_mode():
        nbytes = weight_bytes(ours, x)
    bw = bandwidth_gbs()
    floor = nbytes / bw / 1e6   # ms
    print(f"roofline: {nbytes / 1e6:.1f} MB of weights per forward at {bw:.1f} GB/s read -> {floor:.2f} ms; "
          f"radixserve reaches {floor / ms['radixserve']:.0%} of it; the largest speed-up any "
          f"implementation could show here: " + ", ".join(
              f"{ms[n] / floor:.2f}x over {n}" for n in ("transformers eager", "transformers grouped_mm")))


if __name__ == "__main__":
    main()
