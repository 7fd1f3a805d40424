"""One rank of test_tp.py's TP group: `python -m tests.model.tp_worker RANK ADDR OUT_DIR TP_SIZE EP_SIZE MODEL_DIR...`.

Per model, both ranks build this rank's shard; rank 0 runs an Engine over a TPRunner (greedy prompts), rank 1
follows. Both record each step's logits, token and logit-row counts, each request's pages and start position and
the collective counters, and the parameter bytes (all, and the routed experts'); rank 0 then
runs the same prompts at TP=1. An MLA/DSA model (C47) gets longer prompts (many pages, past index_topk) and a
follow-up that hits the radix cache, and both ranks also record every indexer top-k, their KV pool bytes and pages,
and the stored KV (latent and index keys) of those requests' pages; rank 0 also what export_kv gives a PD transfer.
Results: OUT_DIR/rank{R}.pt, a list with one dict per model."""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from radixserve.dist.comm import init_communicator
from radixserve.engine.engine import Engine
from radixserve.engine_config import EngineConfig
from radixserve.models.dsa import Indexer
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.tp import Followers, TPRunner, follow
from radixserve.sampling_params import SamplingParams

PROMPTS = [[3, 4, 5], [250, 251, 252, 253, 254, 255, 7, 8, 9, 10, 11], list(range(3, 40))]
NUM_NEW = 8
# MLA/DSA (C47): a 100-token prompt (7 pages of 16, past index_topk) and, once it finished, a follow-up sharing its
# first 80 tokens (5 cached pages).
LONG = [(7 * i) % 250 + 3 for i in range(100)]
MLA_PROMPTS, FOLLOW_UP = [*PROMPTS, LONG], [LONG[:80] + [5, 6, 7]]


def recording(runner: ModelRunner, comm=None) -> list[dict]:
    """Wrap runner.forward to record, per step: logits (R, V), T, and the collectives it made."""
    steps: list[dict] = []
    forward = runner.forward

    def recorded(batch):
        before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else None
        step, logits = forward(batch)
        entry = {"logits": logits.clone(), "num_tokens": step.num_tokens,
                 "pages": {s.request_id: list(s.page_ids) for s in batch},
                 "start": {s.request_id: s.start_pos for s in batch}}
        if comm is not None:
            entry["calls"] = {k: v - before[0].get(k, 0) for k, v in comm.calls.items() if v > before[0].get(k, 0)}
            entry["bytes"] = {k: v - before[1].get(k, 0) for k, v in comm.bytes.items() if v > before[1].get(k, 0)}
        steps.append(entry)
        return step, logits

    runner.forward = recorded
    return steps


def greedy_batches(runner, batches: list[tuple[str, list[list[int]]]], num_new: int) -> dict[str, list[int]]:
    """Greedy `num_new` tokens per prompt, batch after batch (each run to the end, so a later batch can hit the
    radix cache); request ids are the batch's prefix and the prompt's index."""
    engine = Engine(runner.config, runner, frozenset())
    tokens: dict[str, list[int]] = {}
    for prefix, batch in batches:
        for i, prompt in enumerate(batch):
            engine.add_request(f"{prefix}{i}", prompt,
                               SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def generate(runner, prompts: list[list[int]] = PROMPTS, follow_up: list[list[int]] = ()) -> dict[str, list[int]]:
    """`prompts` (request ids "0", "1", ...), then `follow_up` ("f0", ...)."""
    return greedy_batches(runner, [("", prompts), ("f", follow_up)], NUM_NEW)


def record_topk(model: torch.nn.Module) -> list:
    """Every Indexer call's output (per segment: (n, K) int64 positions, or None) in call order."""
    chosen: list = []
    for module in model.modules():
        if isinstance(module, Indexer):
            module.register_forward_hook(lambda mod, args, out: chosen.append(out))
    return chosen


def kv_record(runner: ModelRunner, steps: list[dict]) -> dict:
    """The KV pool's size and the stored KV (latent, index keys) of the long prompt's and the follow-up's pages."""
    pages = {}
    for step in steps:
        pages.update(step["pages"])
    kv = runner.kv
    stored = {rid: kv.export_pages(pages[rid]) for rid in (str(len(PROMPTS)), "f0")}
    return {"allocated_bytes": kv.allocated_bytes(), "num_pages": kv.num_pages, "page_size": kv.page_size,
            "stored": {rid: (p.k, p.v, p.side) for rid, p in stored.items()}, "pages": pages}


def export(runner, steps: list[dict]) -> dict:
    """What export_kv gives a PD transfer for every page the steps used (under TP gathered at rank 0), the page count
    and size, and rank 0's collectives during it."""
    pages = sorted({p for step in steps for ids in step["pages"].values() for p in ids})
    comm = getattr(runner, "comm", None)
    before = (dict(comm.calls), dict(comm.bytes)) if comm is not None else ({}, {})
    out = {"data": runner.export_kv(pages), "num_pages": len(pages), "page_size": runner.page_size}
    if comm is not None:
        out["calls"] = {k: v - before[0].get(k, 0) for k, v in comm.calls.items() if v > before[0].get(k, 0)}
        out["bytes"] = {k: v - before[1].get(k, 0) for k, v in comm.bytes.items() if v > before[1].get(k, 0)}
    return out


def main(argv: list[str]) -> int:
    rank, addr, out_dir, folders = int(argv[0]), argv[1], argv[2], argv[5:]
    tp_size, ep_size = int(argv[3]), int(argv[4])
    torch.set_num_threads(1)
    comm = init_communicator(rank, tp_size, addr, 60.0)
    results, keep = [], []
    for folder in folders:
        config = EngineConfig(model_path=folder, tp_size=tp_size, max_total_tokens=4096, quantization="none",
                              page_size=16, chunked_prefill_size=32, num_threads=1, ep_size=ep_size)
        runner = ModelRunner.from_config(config, comm)
        out = {"param_bytes": sum(p.nbytes for p in runner.model.parameters()),
               "expert_bytes": sum(p.nbytes for name, p in runner.model.named_parameters() if ".mlp.experts." in name)}
        out["steps"] = recording(runner, comm)
        mla = runner.model.config.mla is not None
        prompts = (MLA_PROMPTS, FOLLOW_UP) if mla else (PROMPTS,)
        out["topk"] = record_topk(runner.model)
        if rank == 0:
            tp_runner = TPRunner(runner, Followers(comm, []))
            keep.append(tp_runner)
            out["tokens"] = generate(tp_runner, *prompts)
            out["export"] = export(tp_runner, out["steps"])
            tp_runner.followers.stop()
            single = ModelRunner.from_config(dataclasses.replace(config, tp_size=1, ep_size=1))
            out["ref_steps"] = recording(single)
            out["ref_tokens"] = generate(single, *prompts)
            out["ref_export"] = export(single, out["ref_steps"])
            if mla:
                out["ref_kv"] = kv_record(single, out["ref_steps"])
        else:
            follow(runner, comm)
        if mla:
            out["kv"] = kv_record(runner, out["steps"])
        results.append(out)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
