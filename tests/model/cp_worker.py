"""One rank of test_cp.py's CP group: `python -m tests.model.cp_worker RANK SIZE ADDR OUT_DIR MODEL_DIR...`.

Per model and mode (plain CP, LayerSplit, LayerSplit with its KV wait dropped), both ranks build a CPModelRunner; rank 0
runs an Engine over a TPRunner (phase 1: prompts of 1, 2, 3, 37 and 38 tokens, chunked by 32; phase 2, after phase 1
ends: a 64-token prompt, then its 64 tokens + 7 new ones, a radix hit), rank 1 follows. Both record each step's
logits, rows and collectives, rank 0 then the same at CP=1, and rank 0 what export_kv gives a PD transfer. Results:
OUT_DIR/rank{R}.pt, one dict per model."""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from radixserve.chaos.cp_faults import LayerSplitFaults
from radixserve.dist.comm import init_communicator
from radixserve.engine_config import EngineConfig
from radixserve.runner import cp
from radixserve.runner.cp import CPModelRunner
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.tp import Followers, TPRunner, follow
from tests.model.tp_worker import greedy_batches

PHASES = [[[5], [6, 7], [8, 9, 10], list(range(3, 40)), list(range(100, 138))],
          [list(range(150, 214))],
          [list(range(150, 214)) + [11, 12, 13, 14, 15, 16, 17]]]
NUM_NEW = 6
MODES = {"plain": {}, "layer_split": {"enable_layer_split": True}}
KEEP: list = []     # rank 0's TPRunners: one collected would close the group (its finalizer)


def comm_delta(comm, before: tuple[dict, dict]) -> dict:
    """The calls and bytes per op `comm` made since `before` = (dict(comm.calls), dict(comm.bytes))."""
    calls, sent = before
    return {"calls": {k: v - calls.get(k, 0) for k, v in comm.calls.items() if v > calls.get(k, 0)},
            "bytes": {k: v - sent.get(k, 0) for k, v in comm.bytes.items() if v > sent.get(k, 0)}}


def drive_or_follow(runner: ModelRunner, comm, rank: int, generate) -> dict:
    """Rank 0 runs `generate` on a TPRunner over the other ranks ({"tokens": its result}); the others follow ({})."""
    if rank != 0:
        follow(runner, comm)
        return {}
    driver = TPRunner(runner, Followers(comm, []))
    KEEP.append(driver)
    tokens = generate(driver)
    driver.followers.stop()
    return {"tokens": tokens}


def recording(runner: ModelRunner, comm=None) -> list[dict]:
    """Wrap runner.forward to record, per step: logits, the step's rows and pages, and the collectives it made."""
    steps: list[dict] = []
    forward = runner.forward

    def recorded(batch):
        before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else ({}, {})
        step, logits = forward(batch)
        entry = {"logits": logits.clone(), "num_tokens": step.num_tokens, "query_lens": list(step.query_lens),
                 "context_lens": list(step.context_lens_host), "page_lists": [list(p) for p in step.page_lists],
                 "logit_rows": step.logit_rows.tolist()}
        if comm is not None:
            entry.update(comm_delta(comm, before))
        split = getattr(runner, "layer_split", None)
        if split is not None:
            entry["events"] = list(split.events)
        steps.append(entry)
        return step, logits

    runner.forward = recorded
    return steps


def generate(runner) -> dict[str, list[int]]:
    return greedy_batches(runner, [(f"{phase}-", prompts) for phase, prompts in enumerate(PHASES)], NUM_NEW)


def generate_and_export(runner, steps: list[dict], out: dict, comm=None) -> dict[str, list[int]]:
    """generate(), then a PD transfer's export_kv of every page the steps used into out["export"] (and, with `comm`,
    the collectives it made into out["export_comm"])."""
    tokens = generate(runner)
    pages = sorted({p for step in steps for pages in step["page_lists"] for p in pages})
    before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else ({}, {})
    out.update(export=runner.export_kv(pages), export_pages=len(pages))
    if comm is not None:
        out["export_comm"] = comm_delta(comm, before)
    return tokens


def run_mode(config: EngineConfig, comm, rank: int, fault: bool) -> dict:
    runner = CPModelRunner.from_config(config, comm=comm)
    if fault:
        runner.layer_split.fault = LayerSplitFaults(drop_kv_wait=True)
    out = {"kv_bytes": runner.kv.allocated_bytes(), "num_pages": runner.num_pages, "steps": recording(runner, comm)}
    out.update(drive_or_follow(runner, comm, rank, lambda driver: generate_and_export(driver, out["steps"], out, comm)))
    return out


def main(argv: list[str]) -> int:
    rank, size, addr, out_dir, folders = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4:]
    torch.set_num_threads(1)
    cp.QUERY_BLOCK = 5          # several uneven query blocks per sequence even in these short prompts
    comm = init_communicator(rank, size, addr, 60.0)
    results = []
    for folder in folders:
        config = EngineConfig(model_path=folder, cp_size=size, max_total_tokens=4096, quantization="none",
                              page_size=16, chunked_prefill_size=32, num_threads=1)
        out = {name: run_mode(dataclasses.replace(config, **extra), comm, rank, False) for name, extra in MODES.items()}
        out["dropped_wait"] = run_mode(dataclasses.replace(config, enable_layer_split=True), comm, rank, True)
        if rank == 0:
            single = ModelRunner.from_config(dataclasses.replace(config, cp_size=1))
            out["ref"] = {"kv_bytes": single.kv.allocated_bytes(), "steps": recording(single)}
            out["ref"]["tokens"] = generate_and_export(single, out["ref"]["steps"], out["ref"])
        results.append(out)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
