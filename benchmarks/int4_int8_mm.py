"""The default model's 120 int4 matmuls a step, alone: torch's int4 kernel (bf16), radixserve::int4_int8_mm and
radixserve::int4_fp32_mm per path, and the fp32 dequantization on oneDNN (layers/linear.py's packed path).

    PYTHONPATH=. python benchmarks/int4_int8_mm.py [--rows 1,12,256] [--reps 20] [--modes int4,int4-int8,int4-fp32,fp32]

30 layers x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) of random Q4 weights, called in model order
(each weight read once per pass, 53 MB for torch's layout); median ms per pass over --reps, modes alternated per rep.
The weights are random with fp16-exact scales (as Q4_1's), so int4-int8 reads fp16 scales.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from radixserve.layers import batch_invariant as bi
from radixserve.layers import int4_fp32 as fp
from radixserve.layers import int4_int8 as ii
from radixserve.layers.quant_linear import Int4Matmul, Int4Weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,12,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--scalar", action="store_true", help="also the scalar path (slow: about 4 s a pass at 12 rows)")
    ap.add_argument("--modes", default="int4,int4-int8,int4-fp32,fp32")
    args = ap.parse_args()
    wanted = args.modes.split(",")
    gen = torch.Generator().manual_seed(0)
    weights = [Int4Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          (torch.rand(n, k // 32, generator=gen) * 0.02).half().float(), torch.zeros(n, k // 32))
               for _ in range(args.layers) for n, k in SHAPES]
    modes = {"int4 (torch, bf16)": [Int4Matmul([w]) for w in weights]} if "int4" in wanted else {}
    for name, kernel, matmul in (("int4-int8", ii, ii.Int4Int8Matmul), ("int4-fp32", fp, fp.Int4F32Matmul)):
        for isa in [i for i in kernel.supported_isas()[::-1] if name in wanted and (i != "scalar" or args.scalar)]:
            modes[f"{name} {isa}"] = [matmul([w], isa=isa) for w in weights]
    if "fp32" in wanted:
        packed = [bi.pack(w.dequantize()) for w in weights]
        modes["fp32 dense (oneDNN)"] = [lambda x, p=p: bi.matmul(x, p) for p in packed]
    print(f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for mode, mms in modes.items():
                start = time.perf_counter()
                for w, mm in zip(weights, mms):
                    mm(xs[w.codes.shape[1]])
                times[mode].append(time.perf_counter() - start)
        for mode, t in times.items():
            print(f"rows {rows:4d}  {mode:24s} {1000 * statistics.median(t):8.2f} ms a pass")
    print(f"load avg {os.getloadavg()}")


if __name__ == "__main__":
    main()
