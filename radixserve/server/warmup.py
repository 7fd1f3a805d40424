"""--warmup-prompts FILE: prefill known prompts into the radix cache before /health answers.

JSONL: a string, {"prompt": text or token ids} or {"messages": [...]}; each runs with max_tokens=1."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from radixserve.engine.messages import AddReq
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONCURRENCY = 8


class WarmupFileError(ValueError):
    """An unreadable file or a line that is not a prompt."""


def read_prompts(path: str) -> list[dict[str, Any]]:
    """[{"prompt": str | list[int]} | {"messages": list}]; raises WarmupFileError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise WarmupFileError(f"--warmup-prompts {path}: {exc.strerror or exc}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WarmupFileError(f"--warmup-prompts {path} line {n}: not JSON ({exc.msg})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        ok = isinstance(item, dict) and (
            isinstance(item.get("messages"), list) and item["messages"]
            or isinstance(item.get("prompt"), str) and item["prompt"]
            or isinstance(item.get("prompt"), list) and item["prompt"]
            and all(isinstance(t, int) for t in item["prompt"]))
        if not ok:
            raise WarmupFileError(f"--warmup-prompts {path} line {n}: expected a string, "
                                  '{"prompt": text or token ids} or {"messages": [...]}')
        prompts.append(item)
    return prompts


async def warm_up(client: Any, tokenizer: Any, prompts: list[dict[str, Any]]) -> tuple[int, int]:
    """(done, failed); a refused prompt is logged and skipped."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    sem = asyncio.Semaphore(CONCURRENCY)
    failed = 0
    start = time.monotonic()

    async def one(i: int, item: dict[str, Any]) -> None:
        nonlocal failed
        async with sem:
            try:
                if "messages" in item:
                    ids = tokenizer.apply_chat_template(item["messages"])
                elif isinstance(item["prompt"], str):
                    ids = tokenizer.encode(item["prompt"])
                else:
                    ids = item["prompt"]
                stream = client.submit([AddReq(f"warmup-{i}", list(ids), params)])
                try:
                    await stream.accepted()
                    while not (await stream.get()).finished:
                        pass
                finally:
                    stream.close()
            except Exception as exc:
                failed += 1
                logger.warning("warm-up prompt %d skipped: %s", i + 1, exc)

    await asyncio.gather(*(one(i, item) for i, item in enumerate(prompts)))
    logger.info("warmed up %d of %d prompts in %.1f s", len(prompts) - failed, len(prompts),
                time.monotonic() - start)
    return len(prompts) - failed, failed
