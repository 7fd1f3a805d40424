"""Datasets read from local files: ShareGPT-format conversations and timestamped traces (Mooncake JSONL with hash_ids)."""
from __future__ import annotations

import json
import random

from radixserve.bench.workload import BenchRequest, Session, Workload, WordSource, reuse_ratio


def sharegpt_dataset(path: str, source: WordSource, num_prompts: int, seed: int,
                     output_len: int | None = None, context_len: int = 4096) -> Workload:
    """Prompt = turn 0, output len = turn 1's tokens (or `output_len`), filtered as SGLang (< 2, > context_len)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    requests = []
    for conv in convs:
        if len(requests) == num_prompts:
            break
        prompt, answer = conv[0]["value"], conv[1]["value"]
        prompt_len = source.count(prompt)
        out_len = output_len if output_len is not None else source.count(answer)
        if prompt_len < 2 or out_len < 2 or prompt_len + out_len > context_len:
            continue
        requests.append(BenchRequest(prompt, ({"role": "user", "content": prompt},), prompt_len, out_len))
    info = {"dataset_path": path, "sharegpt_output_len": output_len}
    return Workload("sharegpt", [Session((r,)) for r in requests], info)


def _field(row: dict, *names: str) -> int | float:
    for name in names:
        if name in row:
            return row[name]
    raise KeyError(f"trace row has none of {names}: {row}")


def block_text(source: WordSource, hash_id: int, num_tokens: int) -> str:
    """The same words for the same hash id, so shared hash_ids share a prompt prefix."""
    return source.text(random.Random(hash_id * 7919 + 17), num_tokens)


def trace_dataset(path: str, source: WordSource, time_scale: float = 1.0, block_size: int = 512,
                  num_prompts: int | None = None, time_unit_s: float = 1e-3) -> Workload:
    """Replay a JSONL trace (`timestamp`, `input_length`, `output_length`, Mooncake `hash_ids`: one per
    `block_size` tokens); arrival = (timestamp - first) * time_unit_s * time_scale."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:num_prompts] if num_prompts else rows
    t_first = min((float(_field(r, "timestamp", "time")) for r in rows), default=0.0)
    sessions, prompts = [], []
    for i, row in enumerate(rows):
        input_len = int(_field(row, "input_length", "input_len", "prompt_len"))
        output_len = int(_field(row, "output_length", "output_len"))
        hash_ids = row.get("hash_ids") or []
        parts, left = [], input_len
        for hid in hash_ids:
            if left <= 0:
                break
            parts.append(block_text(source, int(hid), min(block_size, left)))
            left -= block_size
        if left > 0:
            parts.append(source.text(random.Random(-1 - i), left))
        text = "".join(parts)
        prompts.append(source.tokenizer.encode(text, add_special_tokens=False))
        offset = (float(_field(row, "timestamp", "time")) - t_first) * time_unit_s * time_scale
        request = BenchRequest(text, ({"role": "user", "content": text},), len(prompts[-1]), output_len)
        sessions.append(Session((request,), arrival_s=offset))
    info = {"dataset_path": path, "time_scale": time_scale, "trace_block_size": block_size,
            "theory_reuse": reuse_ratio(prompts)}
    return Workload("trace", sessions, info)
