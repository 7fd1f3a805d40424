"""Train the default model's EAGLE draft head (a NextN-shaped layer) on make_draft_data.py's output.

    python -m training.train_draft_head DATA.pt[,DATA2.pt...] OUT.safetensors [--vocab 8192] [--epochs 3] [--eval HELDOUT.pt]

The head is models/nextn.py's structure, so the serving path is the one GLM's MTP layers use:
    h'_i = norm(block(eh_proj(cat[enorm(embed(x_{i+1})), hnorm(h_i)])))     block: one Llama decoder layer
    draft logits = lm_head(h'_i) over the `token_map` rows only (the --vocab most frequent greedy tokens)
Targets at row i: the target's greedy token at i + 1 (cross-entropy over the reduced vocabulary, rows whose token is
outside it ignored), or with --soft-labels the target's distribution softmax(lm_head(h_{i+1})) over those rows, and
its hidden state h_{i+1} (smooth L1, EAGLE's feature loss), so that a chain step fed h'_i sees what the target would
have given it. Pass k > 1 of --unroll feeds each row pass k - 1's h'_{i-1} in place of h_i (the input of chain
step k) with the same targets. The block starts as a copy of the target's last
decoder layer with its output projections zeroed (the identity), eh_proj as [0 | I]; AdamW, cosine schedule,
seeded. Written: the NextN tensor names under
`model.layers.{num_layers}.` in bf16 plus `token_map` (int64), with the recipe in the safetensors metadata."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from radixserve.weights.paths import resolve_model_path

# transformers is imported where used: importing this module (as the tests do) must not import triton, whose
# interpreter mode is read once, at its import (tests/model/test_triton_backend.py).


class DraftHead(torch.nn.Module):
    def __init__(self, target: torch.nn.Module):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        c = target.config
        c._attn_implementation = "sdpa"
        h = c.hidden_size
        self.enorm, self.hnorm = LlamaRMSNorm(h, c.rms_norm_eps), LlamaRMSNorm(h, c.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = LlamaDecoderLayer(c, layer_idx=0)
        self.block.load_state_dict(target.model.layers[-1].state_dict())
        self.norm = LlamaRMSNorm(h, c.rms_norm_eps)
        self.norm.load_state_dict(target.model.norm.state_dict())
        with torch.no_grad():
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:].copy_(torch.eye(h))
            # The block starts as the identity (its output projections zero, as in ReZero), so the untrained head
            # repeats the target's own prediction rather than a random one.
            self.block.self_attn.o_proj.weight.zero_()
            self.block.mlp.down_proj.weight.zero_()
        self.rotary = LlamaRotaryEmbedding(c)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden (B, T, H) fp32 -> h' (B, T, H); causal over T, positions 0..T-1."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        out = self.block(x, position_embeddings=self.rotary(x, pos), position_ids=pos)
        return self.norm(out[0] if isinstance(out, tuple) else out)


def nextn_params(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's parameters by their NextN names (below `model.layers.{num_layers}.`)."""
    names = {"enorm.weight": head.enorm.weight, "hnorm.weight": head.hnorm.weight,
             "eh_proj.weight": head.eh_proj.weight, "shared_head.norm.weight": head.norm.weight}
    names.update(head.block.state_dict(keep_vars=True))
    return names


def export_head(head: DraftHead, token_map: torch.Tensor, num_layers: int, path: str, recipe: dict,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `head` as weights/nextn_loader.py's load_draft_head reads it: NextN names under
    `model.layers.{num_layers}.` in `dtype`, `token_map` int64, the recipe as JSON metadata."""
    tensors = {f"model.layers.{num_layers}.{k}": v.detach().to(dtype).contiguous()
               for k, v in nextn_params(head).items()}
    tensors["token_map"] = token_map.to(torch.int64).contiguous()
    save_file(tensors, path, metadata={"radixserve_draft": "eagle-nextn", "recipe": json.dumps(recipe)})


def load_head(path: str, target: torch.nn.Module) -> tuple[DraftHead, torch.Tensor]:
    """(DraftHead, token_map) from a file export_head wrote (for --eval-only); raises KeyError on a missing tensor."""
    from safetensors.torch import load_file

    tensors, prefix = load_file(path), f"model.layers.{target.config.num_hidden_layers}."
    head = DraftHead(target)
    with torch.no_grad():
        for name, param in nextn_params(head).items():
            param.copy_(tensors[prefix + name].float())
    return head.eval(), tensors["token_map"]


def batches(seqs: list[dict], max_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Length-sorted groups of about `max_tokens` padded tokens, in a seeded random order."""
    order = sorted(seqs, key=lambda s: len(s["tokens"]))
    groups, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s["tokens"]) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    groups.append(cur)
    rng.shuffle(groups)
    return groups


def pad(group: list[dict], key: str, width: int, value=0) -> torch.Tensor:
    rows = []
    for s in group:
        t = s[key]
        extra = width - t.shape[0]
        rows.append(F.pad(t, (0, 0, 0, extra) if t.dim() == 2 else (0, extra), value=value))
    return torch.stack(rows)


def step_loss(head: DraftHead, embed: torch.nn.Embedding, lm_rows: torch.Tensor, remap: torch.Tensor,
              group: list[dict], unroll: int, soft_labels: bool) -> tuple[torch.Tensor, dict]:
    width = max(len(s["tokens"]) for s in group)
    tokens = pad(group, "tokens", width)
    hidden = pad(group, "hidden", width).float()
    argmax = pad(group, "argmax", width, value=-1)
    lengths = torch.tensor([len(s["tokens"]) for s in group])
    # Row i: input (h_i, x_{i+1}); targets h_{i+1} and the greedy token at i + 1.
    emb = embed(tokens[:, 1:])
    h_in, h_tgt = hidden[:, :-1], hidden[:, 1:]
    labels = remap[argmax[:, 1:].clamp(min=0)]
    valid = torch.arange(width - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    labels = torch.where(valid & (argmax[:, 1:] >= 0), labels, torch.full_like(labels, -100))
    keep = labels != -100
    soft = torch.softmax(h_tgt[keep] @ lm_rows.T, dim=-1) if soft_labels else labels[keep]
    loss, stats, o = 0.0, {}, h_in
    for k in range(1, unroll + 1):
        o = head(emb, o if k == 1 else torch.cat([h_in[:, :1], o[:, :-1]], dim=1))   # h'_{i-1} in place of h_i
        logits = o[keep] @ lm_rows.T
        ce = F.cross_entropy(logits, soft)
        feat = F.smooth_l1_loss(o[valid], h_tgt[valid])
        loss = loss + (1.0 if k == 1 else 0.5) * (ce + feat)
        with torch.no_grad():
            stats[f"p{k}_acc"] = float((logits.argmax(-1) == labels[keep]).float().mean())
            stats[f"p{k}_ce"], stats[f"p{k}_feat"] = float(ce), float(feat)
    return loss, stats


@torch.no_grad()
def answer_accuracy(head: DraftHead, embed: torch.nn.Embedding, lm_rows: torch.Tensor, token_map: torch.Tensor,
                    seqs: list[dict]) -> dict:
    """Greedy-token accuracy of passes 1, 2 and 3 (chain steps 1, 2 and 3) at answer positions."""
    n, hits = 0, [0, 0, 0]
    for s in seqs:
        tokens, hidden, first = s["tokens"], s["hidden"].float()[None], s["prompt_len"] - 1
        emb, out = embed(tokens[None, 1:]), hidden[:, :-1]
        labels = s["argmax"][1:][first:]
        for k in range(3):
            out = head(emb, out if k == 0 else torch.cat([hidden[:, :1], out[:, :-1]], dim=1))
            hits[k] += int((token_map[(out[0, first:] @ lm_rows.T).argmax(-1)] == labels).sum())
        n += labels.numel()
    return {"answer_tokens": n, "step1_accuracy": round(hits[0] / max(1, n), 4),
            "later_step_accuracy": round(hits[1] / max(1, n), 4), "step3_accuracy": round(hits[2] / max(1, n), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="make_draft_data.py outputs, comma-separated")
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: the most frequent greedy tokens")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--unroll", type=int, default=2, help="training-time chain steps (1: the first only)")
    ap.add_argument("--soft-labels", action="store_true", help="the target's distribution, not its argmax")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", help="a held-out make_draft_data.py output: accuracy reported and kept in the recipe")
    ap.add_argument("--eval-only", metavar="HEAD", help="report HEAD's accuracy on --eval (DATA and OUT unused)")
    ap.add_argument("--bf16", action="store_true", help="train under bf16 autocast (fast where the CPU has AMX)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = resolve_model_path(None)
    target = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
    if args.eval_only:
        head, token_map = load_head(args.eval_only, target)
        lm_rows = target.lm_head.weight.detach()[token_map]
        print(answer_accuracy(head, target.model.embed_tokens, lm_rows, token_map,
                              torch.load(args.eval, weights_only=False)["sequences"]))
        return
    parts = [torch.load(part, weights_only=False) for part in args.data.split(",")]
    seqs = [s for part in parts for s in part["sequences"]]
    counts = torch.bincount(torch.cat([s["argmax"] for s in seqs]), minlength=target.config.vocab_size)
    token_map = counts.argsort(descending=True)[:args.vocab].sort().values
    coverage = float(counts[token_map].sum() / counts.sum())
    remap = torch.full((target.config.vocab_size,), -100, dtype=torch.int64)
    remap[token_map] = torch.arange(len(token_map))
    embed = target.model.embed_tokens.requires_grad_(False)
    lm_rows = target.lm_head.weight.detach()[token_map]
    head = DraftHead(target)
    params = [p for n, p in head.named_parameters() if "rotary" not in n]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(batches(seqs, args.batch_tokens, random.Random(0)))
    total = max(1, int(args.epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    print(f"{len(seqs)} sequences, {sum(len(s['tokens']) for s in seqs)} tokens; draft vocab {len(token_map)} covers "
          f"{coverage:.4f} of greedy tokens; {total} steps", flush=True)
    step, t0, window = 0, time.perf_counter(), []
    while step < total:
        for group in batches(seqs, args.batch_tokens, rng):
            if step >= total:
                break
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, stats = step_loss(head, embed, lm_rows, remap, group, args.unroll, args.soft_labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            window.append(stats)
            if step % 25 == 0 or step == total:
                mean = {k: round(sum(w[k] for w in window) / len(window), 4) for k in window[0]}
                print(f"step {step}/{total} {time.perf_counter() - t0:.0f}s {mean}", flush=True)
                window = []
    head.eval()
    held_out = (answer_accuracy(head, embed, lm_rows, token_map, torch.load(args.eval, weights_only=False)["sequences"])
                if args.eval else None)
    recipe = {"base": os.path.basename(path), "held_out": held_out, "data": [part["meta"] for part in parts], "vocab": len(token_map),
              "coverage": round(coverage, 4), "epochs": args.epochs, "lr": args.lr,
              "batch_tokens": args.batch_tokens, "unroll": args.unroll, "soft_labels": args.soft_labels,
              "weight_decay": args.weight_decay, "seed": args.seed, "bf16": args.bf16,
              "steps": total, "train_s": round(time.perf_counter() - t0)}
    export_head(head, token_map, target.config.num_hidden_layers, args.out, recipe)
    print("wrote", args.out, recipe)


if __name__ == "__main__":
    main()
