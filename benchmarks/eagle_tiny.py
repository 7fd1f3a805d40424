"""EAGLE / MTP drafting mechanics on the tiny glm4_moe of tests/model/mtp_checkpoint.py (not a real model's speed).

Run:  PYTHONPATH=. python benchmarks/eagle_tiny.py

Two checkpoints: `exact` (the MTP layer predicts the target's next token exactly) and `random`; each served
without speculation and with `--speculative-algorithm EAGLE --speculative-num-steps 3`, alternating twice,
one greedy request at a time (4 prompts x 64 tokens, 1 thread). Prints output tok/s and the accept length
(tokens per verify step, bonus counted). On a 3-layer model every forward's fixed cost (step build, the MoE
expert loop) dominates, so the draft's extend and chain forwards cost about as much as the target's: the
ratio says nothing about a 46- or 92-layer GLM, where the draft is one layer of the step.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
import time

from tests.model.mtp_checkpoint import build_glm_mtp
from tests.model.parity import engine_generate
from tests.model.test_parity import make_engine, prompt_set

EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp())
    prompts = prompt_set(256, 9, [20, 50, 80, 110])
    for name in ("exact", "random"):
        folder = root / name
        folder.mkdir()
        build_glm_mtp(folder, exact=name == "exact")
        for label, cfg in (("off", {}), ("EAGLE", EAGLE)) * 2:
            engine = make_engine(folder, num_threads=1, **cfg)
            engine_generate(engine, prompts[:1], 8)
            start = time.perf_counter()
            engine_generate(engine, prompts, 64, at_once=False)
            seconds = time.perf_counter() - start
            s = engine.stats()
            steps = s["spec_num_verify_steps"]
            length = (s["spec_num_accepted_tokens"] + steps) / steps if steps else float("nan")
            print(f"{name:6s} {label:5s} {len(prompts) * 64 / seconds:7.1f} tok/s  verify steps {steps:3d}  "
                  f"accept length {length:.2f}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
