"""One rank of test_tp.py's TP=2 group: `python -m tests.model.tp_worker RANK ADDR OUT_DIR [--ep-size N] MODEL_DIR...`.

Per model, both ranks build this rank's shard; rank 0 runs an Engine over a TPRunner (greedy prompts), rank 1
follows. Both record each step's logits, token and logit-row counts and the collective counters, and the parameter
bytes (all, and the routed experts'); rank 0 then
runs the same prompts at TP=1. Results: OUT_DIR/rank{R}.pt, a list with one dict per model."""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from radixserve.dist.comm import init_communicator
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.tp import Followers, TPRunner, follow
from radixserve.sampling_params import SamplingParams

PROMPTS = [[3, 4, 5], [250, 251, 252, 253, 254, 255, 7, 8, 9, 10, 11], list(range(3, 40))]
NUM_NEW = 8


def recording(runner: ModelRunner, comm=None) -> list[dict]:
    """Wrap runner.forward to record, per step: logits (R, V), T, and the collectives it made."""
    steps: list[dict] = []
    forward = runner.forward

    def recorded(batch):
        before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else None
        step, logits = forward(batch)
        entry = {"logits": logits.clone(), "num_tokens": step.num_tokens}
        if comm is not None:
            entry["calls"] = {k: v - before[0].get(k, 0) for k, v in comm.calls.items() if v > before[0].get(k, 0)}
            entry["bytes"] = {k: v - before[1].get(k, 0) for k, v in comm.bytes.items() if v > before[1].get(k, 0)}
        steps.append(entry)
        return step, logits

    runner.forward = recorded
    return steps


def generate(runner) -> dict[str, list[int]]:
    engine = Engine(runner.config, runner, frozenset())
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def main(argv: list[str]) -> int:
    rank, addr, out_dir, folders = int(argv[0]), argv[1], argv[2], argv[3:]
    ep_size = 1
    if folders[0] == "--ep-size":
        ep_size, folders = int(folders[1]), folders[2:]
    torch.set_num_threads(1)
    comm = init_communicator(rank, 2, addr, 60.0)
    results, keep = [], []
    for folder in folders:
        config = EngineConfig(model_path=folder, tp_size=2, max_total_tokens=4096, quantization="none",
                              chunked_prefill_size=32, num_threads=1, ep_size=ep_size)
        runner = ModelRunner.from_config(config, comm)
        out = {"param_bytes": sum(p.nbytes for p in runner.model.parameters()),
               "expert_bytes": sum(p.nbytes for name, p in runner.model.named_parameters() if ".mlp.experts." in name)}
        out["steps"] = recording(runner, comm)
        if rank == 0:
            tp_runner = TPRunner(runner, Followers(comm, []))
            keep.append(tp_runner)
            out["tokens"] = generate(tp_runner)
            tp_runner.followers.stop()
            single = ModelRunner.from_config(dataclasses.replace(config, tp_size=1, ep_size=1))
            out["ref_steps"] = recording(single)
            out["ref_tokens"] = generate(single)
        else:
            follow(runner, comm)
        results.append(out)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
