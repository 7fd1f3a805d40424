"""Structured output on the default model: schema validity over many prompts and the throughput cost against unconstrained decoding, same run.

Run:  python benchmarks/structured_output.py [--prompts-per-schema 20] [--max-tokens 160]

10 JSON schemas (objects, nested objects, arrays, enums, numbers, booleans, optional fields) x
N chat prompts, greedy and T=0.7 seeded alternately, all submitted at once through the offline
API. Every constrained output is parsed and checked with `jsonschema`. Then the same prompts
run unconstrained, each forced to the same number of output tokens as its constrained run
(max_tokens = that count, ignore_eos), so both runs do identical model work and the wall-time
ratio is the cost of the grammar masks. Printed with the load average.
tests/model/test_structured_output.py runs the same code scaled down.
"""
from __future__ import annotations

import argparse
import json
import os
import time

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "country": {"type": "string", "maxLength": 30},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                               "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 50},
                                      "done": {"type": "boolean"}},
     "required": ["title", "done"], "additionalProperties": False},
    {"type": "object", "properties": {"author": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 20}, "last": {"type": "string", "maxLength": 20}},
        "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer", "minimum": 0, "maximum": 2100}}, "required": ["author", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": {"type": "string", "maxLength": 30}},
        "required": ["n", "text"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "hex": {"type": "string", "maxLength": 7}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
                                      "explanation": {"type": "string", "maxLength": 60}},
     "required": ["answer", "explanation"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 100},
                                      "note": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["ok", "score", "note"], "additionalProperties": False},
]
TOPICS = ["a famous scientist", "a city in Europe", "a movie review", "a cooking recipe", "a todo item",
          "a classic novel", "a math problem", "a painting", "a sports team", "a programming language",
          "a planet", "a bird", "a holiday", "a song", "a museum", "a mountain", "a river", "a car",
          "a board game", "a chemical element"]


def requests(per_schema: int, max_tokens: int):
    from radixserve import SamplingParams

    items = []
    for s, schema in enumerate(SCHEMAS):
        for p in range(per_schema):
            topic = TOPICS[(s + p) % len(TOPICS)]
            messages = [{"role": "user", "content": f"Describe {topic} as JSON matching this schema: "
                                                    f"{json.dumps(schema)}"}]
            temperature = 0.0 if p % 2 == 0 else 0.7
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=p,
                                    json_schema=json.dumps(schema))
            items.append((schema, messages, params))
    return items


def run(llm, per_schema: int, max_tokens: int, compare: bool = True) -> dict:
    """Constrained then (`compare`) unconstrained over the same prompts; returns validity and
    tok/s of each."""
    import dataclasses

    import jsonschema

    items = requests(per_schema, max_tokens)
    llm.chat([items[0][1]], [items[0][2]], use_tqdm=False)   # load the grammar compiler outside the timing
    results = {}
    lengths: list[int] = []
    for label, constrained in (("constrained", True), ("unconstrained", False))[:2 if compare else 1]:
        params = [p if constrained else dataclasses.replace(p, json_schema=None, max_tokens=n, ignore_eos=True)
                  for (_, _, p), n in zip(items, lengths or [0] * len(items))]
        llm.engine.flush_cache()
        start = time.perf_counter()
        outs = llm.chat([m for _, m, _ in items], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        lengths = lengths or [len(o.outputs[0].token_ids) for o in outs]
        valid = 0
        invalid = []
        for (schema, _, _), out in zip(items, outs):
            try:
                jsonschema.validate(json.loads(out.outputs[0].text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid.append((out.outputs[0].text[:80], out.outputs[0].finish_reason, str(exc)[:80]))
        results[label] = {"valid": valid, "total": len(items), "tok_s": tokens / elapsed,
                          "tokens": tokens, "invalid": invalid}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-schema", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    from radixserve import LLM

    llm = LLM(max_total_tokens=65536)
    r = run(llm, args.prompts_per_schema, args.max_tokens)
    c, u = r["constrained"], r["unconstrained"]
    print(f"load {os.getloadavg()[0]:.2f}; {c['total']} prompts, {len(SCHEMAS)} schemas, max_tokens {args.max_tokens}")
    print(f"constrained:   {c['valid']}/{c['total']} schema-valid, {c['tokens']} tokens, {c['tok_s']:.1f} tok/s")
    print(f"unconstrained: {u['valid']}/{u['total']} schema-valid, {u['tokens']} tokens, {u['tok_s']:.1f} tok/s")
    print(f"constrained / unconstrained throughput (same prompts, same token counts): {c['tok_s'] / u['tok_s']:.3f}")
    for text, finish, why in c["invalid"][:5]:
        print(f"  invalid ({finish}): {text!r}: {why}")


if __name__ == "__main__":
    main()
