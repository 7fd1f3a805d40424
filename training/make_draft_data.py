"""Self-distillation data for the default model's draft head: the model's own greedy answers to the prompt mix,
with its hidden states.

    python -m training.make_draft_data OUT.pt [--prompts 1200] [--max-tokens 256] [--split train] [--seed 0]
        [--mix 1|2] [--exclude-mix1 N] [--temperature T]

Step 1 generates with radixserve's offline engine (the default model without speculation, chat template; greedy,
or sampled with a seed per prompt). Step 2 runs
transformers' LlamaForCausalLM on the same GGUF over each prompt + answer and keeps, per sequence:
    tokens  (T,) int64              the chat-templated prompt and the answer
    hidden  (T, hidden_size) bf16   the last decoder output after the final norm (the LM head's input)
    argmax  (T,) int64              the target's greedy next token at every position (lm_head(hidden) in fp32):
                                    the training label, also where a sampled answer took another token
    prompt_len                      where the answer starts
Written with torch.save as {"sequences": [...], "meta": {...}}; deterministic for its arguments."""
from __future__ import annotations

import argparse
import os
import time

import torch

from radixserve.weights.paths import resolve_model_path
from training.prompt_mix import prompts


def generate(items: list[tuple[str, str]], max_tokens: int, temperature: float,
             gen_dtype: str = "auto") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per item, from radixserve's engine on the default model without speculation;
    greedy at temperature 0, else sampled with seed = the item's index. `gen_dtype` "bfloat16": the engine on
    dequantized bf16 weights (faster where the CPU has AMX; the answers may part from the int4 engine's after a
    near-tie, the labels stay the fp32 target's)."""
    from radixserve.llm import LLM
    from radixserve.sampling_params import SamplingParams
    dtype = {} if gen_dtype == "auto" else {"quantization": "none", "dtype": gen_dtype}
    llm = LLM(None, max_running_requests=64, speculative_algorithm="none", **dtype)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i) for i in range(len(items))]
    try:
        outs = llm.chat([[{"role": "user", "content": text}] for _, text in items], params, use_tqdm=False)
    finally:
        llm.close()
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


@torch.no_grad()
def hidden_states(pairs: list[tuple[list[int], list[int]]], batch_tokens: int = 4096) -> list[dict]:
    """Run transformers' model over each prompt + answer (one sequence at a time, sorted by length, padded
    batches of about `batch_tokens` tokens; right padding never changes the rows of a causal model)."""
    from transformers import AutoModelForCausalLM
    path = resolve_model_path(None)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    seqs = [p + a for p, a in pairs]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[dict | None] = [None] * len(seqs)
    start = 0
    while start < len(order):
        longest = len(seqs[order[start]])
        end = start
        while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= max(batch_tokens, longest):
            end += 1
        chunk = order[start:end]
        width = len(seqs[chunk[-1]])
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        for row, i in enumerate(chunk):
            ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
        h = model.model(input_ids=ids).last_hidden_state
        for row, i in enumerate(chunk):
            n = len(seqs[i])
            hi = h[row, :n]
            out[i] = {"tokens": torch.tensor(seqs[i]), "hidden": hi.to(torch.bfloat16),
                      "argmax": model.lm_head(hi).argmax(-1), "prompt_len": len(pairs[i][0])}
        start = end
    return out  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--split", default="train", choices=("train", "heldout"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", type=int, default=1, choices=(1, 2), help="training/prompt_mix.py's mix")
    ap.add_argument("--exclude-mix1", type=int, default=0, metavar="N",
                    help="leave out the first N prompts of mix 1 (seed 0): another data set's")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers, else sampled")
    ap.add_argument("--gen-dtype", default="auto", choices=("auto", "bfloat16"),
                    help="the answering engine's weights: auto (the served int4) or bf16")
    args = ap.parse_args()
    torch.manual_seed(0)
    exclude = frozenset(text for _, text in prompts(args.exclude_mix1, args.split, 0)) if args.exclude_mix1 else frozenset()
    items = prompts(args.prompts, args.split, args.seed, args.mix, exclude)
    t0 = time.perf_counter()
    pairs = generate(items, args.max_tokens, args.temperature, args.gen_dtype)
    t1 = time.perf_counter()
    seqs = hidden_states(pairs)
    t2 = time.perf_counter()
    answers = sum(len(a) for _, a in pairs)
    agree = sum(int((s["argmax"][s["prompt_len"] - 1:-1] == s["tokens"][s["prompt_len"]:]).sum()) for s in seqs)
    meta = {"prompts": len(items), "split": args.split, "seed": args.seed, "mix": args.mix,
            "exclude_mix1": args.exclude_mix1, "temperature": args.temperature, "max_tokens": args.max_tokens,
            "gen_dtype": args.gen_dtype,
            "answer_tokens": answers, "tokens": sum(len(s["tokens"]) for s in seqs),
            "transformers_agrees_with_engine": agree / max(1, answers),
            "generate_s": round(t1 - t0, 1), "hidden_s": round(t2 - t1, 1)}
    torch.save({"sequences": seqs, "meta": meta}, args.out)
    print(meta)


if __name__ == "__main__":
    main()
