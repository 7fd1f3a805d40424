"""One stage of test_pp.py's PP group: `python -m tests.model.pp_worker RANK SIZE ADDR OUT_DIR MODEL_DIR...`.

Per model and micro-batch count M (MICRO: None = --pp-size), every rank builds its PPModelRunner; rank 0 runs an
Engine over a TPRunner (tests/model/cp_worker.py's phases: prompts of 1, 2, 3, 37 and 38 tokens chunked by 32, then
a 64-token prompt and the same 64 tokens + 7 new ones, a radix hit), the others follow. Each records its steps'
logits, batch sizes and point-to-point counters, its parameter and KV bytes, every DSA indexer top-k, and the pages
it sizes without --max-total-tokens; rank 0 then runs the same at PP=1. Last, at PP=2, a hung stage: rank 0 waits in a receive
that the last stage never sends (it sleeps past the group's timeout). Results: OUT_DIR/rank{R}.pt, a dict per model."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from radixserve.dist.comm import DistError, init_communicator
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.pp import PPModelRunner
from radixserve.sampling_params import SamplingParams
from tests.model.cp_worker import NUM_NEW, PHASES, comm_delta, drive_or_follow
from tests.model.tp_worker import record_topk

MICRO = (None, 1, 3)
TIMEOUT_S = 10.0


def generate(runner) -> dict[str, list]:
    """cp_worker's phases, greedy; the 37-token prompt also asks for its prompt logprobs (several logit rows per
    sequence in each of its chunks). Returns each request's tokens, and under "prompt_logprobs" that request's
    (token id, logprob, top-2 token ids) per prompt position."""
    engine = Engine(runner.config, runner, frozenset())
    out: dict[str, list] = {}
    for phase, prompts in enumerate(PHASES):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                                    prompt_logprobs=2 if len(prompt) == 37 else None)
            engine.add_request(f"{phase}-{i}", prompt, params)
        while engine.has_unfinished():
            for item in engine.step():
                out.setdefault(item.request_id, []).extend(item.new_token_ids)
                for lp in item.prompt_logprobs or ():
                    out.setdefault("prompt_logprobs", []).append((lp.token_id, lp.logprob, [t for t, _ in lp.top]))
    return out


def recording(runner: ModelRunner, comm=None) -> list[dict]:
    """Wrap runner.forward to record, per step: logits, T, sequences, query lengths and the p2p ops it made."""
    steps: list[dict] = []
    forward = runner.forward

    def recorded(batch):
        before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else ({}, {})
        step, logits = forward(batch)
        entry = {"logits": logits.clone(), "num_tokens": step.num_tokens, "num_seqs": len(batch),
                 "query_lens": list(step.query_lens), "context_lens": list(step.context_lens_host),
                 "logit_rows": step.logit_rows.numel(),
                 "seq_logit_rows": [sum(1 for r in step.logit_rows.tolist() if a <= r < a + n)
                                    for a, n in zip(step.query_starts, step.query_lens)]}
        if comm is not None:
            entry.update(comm_delta(comm, before))
        steps.append(entry)
        return step, logits

    runner.forward = recorded
    return steps


def run_micro(config: EngineConfig, comm, rank: int) -> dict:
    runner = PPModelRunner.from_config(config, comm=comm)
    out = {"param_bytes": sum(p.nbytes for p in runner.model.parameters()), "kv_bytes": runner.kv.allocated_bytes(),
           "num_pages": runner.num_pages, "kv_layers": runner.kv.num_layers, "steps": recording(runner, comm),
           "topk": record_topk(runner.model)}
    return {**out, **drive_or_follow(runner, comm, rank, generate)}


def main(argv: list[str]) -> int:
    rank, size, addr, out_dir, folders = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4:]
    torch.set_num_threads(1)
    comm = init_communicator(rank, size, addr, TIMEOUT_S)
    results = []
    for folder in folders:
        config = EngineConfig(model_path=folder, pp_size=size, max_total_tokens=4096, quantization="none",
                              page_size=16, chunked_prefill_size=32, num_threads=1)
        out = {m: run_micro(dataclasses.replace(config, pp_micro_batches=m), comm, rank) for m in MICRO}
        sized = PPModelRunner.from_config(dataclasses.replace(config, max_total_tokens=None, kv_cache_memory_gb=0.001),
                                          comm=comm)
        out["sized_pages"] = sized.num_pages
        if rank == 0:
            single = ModelRunner.from_config(dataclasses.replace(config, pp_size=1))
            out["ref"] = {"param_bytes": sum(p.nbytes for p in single.model.parameters()),
                          "kv_bytes": single.kv.allocated_bytes(), "steps": recording(single),
                          "topk": record_topk(single.model)}
            out["ref"]["tokens"] = generate(single)
        results.append(out)
    hung = {}
    if size == 2 and rank == 0:
        start = time.monotonic()
        try:
            comm.recv(torch.empty(4), size - 1)
        except DistError as exc:
            hung = {"error": str(exc), "waited_s": time.monotonic() - start}
    elif size == 2:             # silent until rank 0 has waited out the timeout and saved (at most TIMEOUT_S + 5 s)
        deadline = time.monotonic() + TIMEOUT_S + 5
        while time.monotonic() < deadline and not os.path.exists(os.path.join(out_dir, "rank0.pt")):
            time.sleep(0.1)
    torch.save({"models": results, "hung": hung}, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
