"""One rank of test_pp_tp.py's group: `python -m tests.model.pp_tp_worker RANK ADDR OUT_DIR (MODEL_DIR EP_SIZE)...`.

--pp-size 2 --tp-size 2 over 4 ranks (rank = stage * 2 + tp_rank). Per model every rank builds its runner with
runner/tp.py's rank_runner (its stage's layers, its TP shard of them); rank 0 runs pp_worker's phases on an Engine over
a TPRunner, the others follow. Each records its steps' logits and batch sizes, the world group's point-to-point and the
TP group's collective counters, its parameter and KV bytes, and the pages it sizes without --max-total-tokens; rank 0
then runs the same at PP=1 TP=1. Results: OUT_DIR/rank{R}.pt. Last, rank 0 runs one more request and rank 3 exits
inside its forward: every survivor's DistError (or None) and its wait go to OUT_DIR/dead{R}.pt."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from radixserve.dist.comm import DistError, init_communicator
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.pp import PPModelRunner
from radixserve.runner.tp import Followers, TPRunner, follow, rank_runner
from tests.model.cp_worker import KEEP, comm_delta, drive_or_follow
from tests.model.pp_worker import generate, recording

PP, TP = 2, 2
TIMEOUT_S = 10.0


def tp_recording(runner: ModelRunner) -> list[dict]:
    """Wrap runner.forward (again) to record, per step, the collectives its TP group made."""
    steps: list[dict] = []
    forward = runner.forward

    def recorded(batch):
        before = (dict(runner.tp.calls), dict(runner.tp.bytes))
        out = forward(batch)
        steps.append(comm_delta(runner.tp, before))
        return out

    runner.forward = recorded
    return steps


def dead_rank(runner: ModelRunner, comm, rank: int, out_dir: str) -> None:
    """Rank 0 runs one more request, the others follow; rank 3 exits when that step's forward starts."""
    if rank == 3:
        runner.forward = lambda batch: os._exit(0)
    start, error = time.monotonic(), None
    try:
        if rank == 0:
            generate(TPRunner(runner, Followers(comm, [])))
        else:
            follow(runner, comm)
    except DistError as exc:
        error = str(exc)
    torch.save({"error": error, "waited_s": time.monotonic() - start}, os.path.join(out_dir, f"dead{rank}.pt"))


def main(argv: list[str]) -> int:
    rank, addr, out_dir, cases = int(argv[0]), argv[1], argv[2], argv[3:]
    torch.set_num_threads(1)
    comm = init_communicator(rank, PP * TP, addr, TIMEOUT_S)
    results = []
    for folder, ep in zip(cases[::2], map(int, cases[1::2])):
        config = EngineConfig(model_path=folder, pp_size=PP, tp_size=TP, ep_size=ep, max_total_tokens=4096,
                              quantization="none", chunked_prefill_size=32, num_threads=1, dist_timeout=TIMEOUT_S,
                              page_size=16)
        runner = rank_runner(config, comm)
        out = {"param_bytes": sum(p.nbytes for p in runner.model.parameters()), "kv_bytes": runner.kv.allocated_bytes(),
               "num_pages": runner.num_pages, "kv_layers": runner.kv.num_layers, "steps": recording(runner, comm),
               "stage": (runner.stage, runner.tp_rank)}
        out["tp_steps"] = tp_recording(runner)
        out.update(drive_or_follow(runner, comm, rank, generate))
        sized = PPModelRunner.from_config(dataclasses.replace(config, max_total_tokens=None, kv_cache_memory_gb=0.001),
                                          runner.tp, comm=comm)
        out["sized_pages"] = sized.num_pages
        if rank == 0:
            single = ModelRunner.from_config(dataclasses.replace(config, pp_size=1, tp_size=1, ep_size=1))
            out["ref"] = {"param_bytes": sum(p.nbytes for p in single.model.parameters()), "steps": recording(single)}
            out["ref"]["tokens"] = generate(single)
        results.append(out)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dead_rank(runner, comm, rank, out_dir)
    KEEP.clear()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
