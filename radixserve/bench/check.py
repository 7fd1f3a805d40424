"""`radixserve bench --save-output FILE` / `--check-output REF`: every greedy output of a run compared token by token with a reference run.

The reference is a `--save-output` file or a server sent the same requests; both ask for top-2 logprobs.
Each request is identical, a tie (first difference where the reference's top-2 gap < `tie_gap`),
corrupted, a guard abort, or failed (not compared); rates per 10,000 compared. Greedy only."""
from __future__ import annotations

import json
from collections.abc import Sequence

from radixserve.bench.metrics import RequestResult

TIE_GAP = 1e-3       # top-2 logprob gap below this is a numerical tie
MAX_EXAMPLES = 10    # corrupted requests listed in the report


def logprob_fields(backend: str) -> dict:
    return {"logprobs": True, "top_logprobs": 2} if backend == "chat" else {"logprobs": 2}


def chunk_tokens(chunk: dict, backend: str) -> list[tuple[str, float | None]]:
    """(token text, top-2 logprob gap or None) for each token of one streamed chunk."""
    choices = chunk.get("choices") or []
    lp = (choices[0].get("logprobs") if choices else None) or {}
    if backend == "chat":
        return [(t["token"], _gap([x["logprob"] for x in t.get("top_logprobs") or []]))
                for t in lp.get("content") or []]
    tops = lp.get("top_logprobs") or []
    return [(tok, _gap(list((tops[i] or {}).values())) if i < len(tops) else None)
            for i, tok in enumerate(lp.get("tokens") or [])]


def _gap(logprobs: Sequence[float]) -> float | None:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def is_guard_abort(result: RequestResult) -> bool:
    return "output_anomaly" in result.error


def save(path: str, results: Sequence[RequestResult]) -> None:
    """One JSON line per request, in request order: index, tokens, top-2 gaps, text, error."""
    with open(path, "w", encoding="utf-8") as f:
        for r in sorted(results, key=lambda r: r.index):
            f.write(json.dumps({"index": r.index, "tokens": r.tokens, "gaps": r.top2_gaps,
                                "text": r.generated_text, "error": r.error}) + "\n")


def load(path: str) -> dict[int, dict]:
    """A file written by `save`: index -> record. Raises ValueError for a line that is not one."""
    out: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            rec = json.loads(line)
            if not isinstance(rec, dict) or not {"index", "tokens", "gaps"} <= rec.keys():
                raise ValueError(f"{path}:{n}: not a --save-output record")
            out[int(rec["index"])] = rec
    return out


def as_reference(results: Sequence[RequestResult]) -> dict[int, dict]:
    """A reference run's results as `load` returns them (failed requests left out)."""
    return {r.index: {"index": r.index, "tokens": r.tokens, "gaps": r.top2_gaps}
            for r in results if r.success}


def compare(reference: dict[int, dict], results: Sequence[RequestResult],
            tie_gap: float = TIE_GAP) -> dict:
    """The check report (module doc) of `results` against `reference`."""
    counts = {"identical": 0, "tie": 0, "corrupted": 0, "guard_abort": 0, "failed": 0,
              "no_reference": 0}
    examples: list[dict] = []
    for r in sorted(results, key=lambda r: r.index):
        ref = reference.get(r.index)
        if is_guard_abort(r):
            counts["guard_abort"] += 1
        elif not r.success:
            counts["failed"] += 1
        elif ref is None:
            counts["no_reference"] += 1
        elif r.tokens == ref["tokens"]:
            counts["identical"] += 1
        else:
            a, b = ref["tokens"], r.tokens
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = ref["gaps"][i] if i < len(ref["gaps"]) else None
            kind = "tie" if gap is not None and gap < tie_gap else "corrupted"
            counts[kind] += 1
            if kind == "corrupted" and len(examples) < MAX_EXAMPLES:
                examples.append({"index": r.index, "position": i, "top2_gap": gap,
                                 "expected": a[i] if i < len(a) else None,
                                 "got": b[i] if i < len(b) else None})
    return _report(counts, tie_gap, examples)


def _report(counts: dict[str, int], tie_gap: float, examples: list[dict]) -> dict:
    judged = counts["identical"] + counts["tie"] + counts["corrupted"] + counts["guard_abort"]
    per_10k = (lambda n: 1e4 * n / judged if judged else None)
    return {**counts, "compared": judged, "tie_gap": tie_gap,
            "corrupted_per_10k": per_10k(counts["corrupted"]),
            "guard_aborts_per_10k": per_10k(counts["guard_abort"]),
            "first_corrupted": examples[:MAX_EXAMPLES]}


def merge(reports: Sequence[dict]) -> dict:
    """Runs' reports merged (counts summed, rates recomputed, `index` per run); ValueError: none, or tie gaps differ."""
    if not reports or len({r["tie_gap"] for r in reports}) != 1:
        raise ValueError("merge needs at least one report, all with the same tie_gap")
    keys = ("identical", "tie", "corrupted", "guard_abort", "failed", "no_reference")
    counts = {k: sum(r[k] for r in reports) for k in keys}
    return _report(counts, reports[0]["tie_gap"], [e for r in reports for e in r["first_corrupted"]])


def summary_line(report: dict) -> str:
    head = (f"check-output: {report['compared']} compared, {report['identical']} identical, "
            f"{report['tie']} tie, {report['corrupted']} corrupted "
            f"({report['corrupted_per_10k'] or 0:.1f} per 10k), {report['guard_abort']} guard "
            f"aborts ({report['guard_aborts_per_10k'] or 0:.1f} per 10k), {report['failed']} "
            f"failed, {report['no_reference']} without reference")
    lines = [head] + [f"  request {e['index']}: first difference at token {e['position']} "
                      f"(top-2 gap {e['top2_gap']}): expected {e['expected']!r}, got {e['got']!r}"
                      for e in report["first_corrupted"]]
    return "\n".join(lines)
