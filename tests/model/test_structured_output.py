"""Structured output (issue 15): grammar masks from xgrammar on the default model's vocabulary.

The scaled-down run of benchmarks/structured_output.py (10 schemas, greedy and sampled: every
output schema-valid), the mask life cycle (complete -> only end of sequence; a token that
breaks the grammar -> only end of sequence; a matcher lost to the LRU is rebuilt from the output
ids with the same mask, as after preemption), and schemas refused before anything is queued.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
from dataclasses import dataclass, field

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.errors import InvalidRequest
from radixserve.runner.structured import StructuredOutput
from radixserve.weights.paths import resolve_model_path

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "structured_output.py"
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False})


@dataclass
class Row:
    request_id: str
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_total_tokens=16384)


def test_every_output_matches_its_schema(llm):
    spec = importlib.util.spec_from_file_location("structured_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # One prompt per schema: every schema's grammar is exercised; the benchmark runs more.
    result = bench.run(llm, per_schema=1, max_tokens=160, compare=False)["constrained"]
    assert result["valid"] == result["total"] == len(bench.SCHEMAS) == 10, result["invalid"]


def allowed(so: StructuredOutput, rows: list[Row], vocab: int) -> torch.Tensor:
    """(n, V) bool: the tokens each row may sample after the constraint is applied."""
    logits = torch.zeros(len(rows), vocab)
    constrain = so.token_mask(rows, torch.device("cpu"))
    if constrain is not None:
        constrain(logits)
    return torch.isfinite(logits)


def test_mask_life_cycle(llm):
    runner = llm.engine.runner
    so = StructuredOutput(resolve_model_path(None), runner.vocab_size, runner.eos_token_ids, max_matchers=1)
    tok = llm.tokenizer
    params = SamplingParams(json_schema=SCHEMA)
    text_ids = tok.encode('{"ok": true}')
    row = Row("a", params)
    V = runner.vocab_size
    assert so.token_mask([Row("free", SamplingParams())], torch.device("cpu")) is None
    first = allowed(so, [row, Row("free", SamplingParams())], V)
    assert bool(first[1].all()) and not bool(first[0].all())
    assert bool(first[0, text_ids[0]]) and not bool(first[0, tok.encode("Hello")[0]])
    row.output_ids = text_ids[:2]
    partial = allowed(so, [row], V)
    allowed(so, [Row("other", params)], V)                               # evicts "a" (max_matchers=1)
    assert torch.equal(allowed(so, [row], V), partial)                   # rebuilt from output ids
    row.output_ids = list(text_ids)
    done = allowed(so, [row], V)[0]
    assert set(done.nonzero().flatten().tolist()) == set(so.eos_token_ids)
    broken = Row("b", params, tok.encode("Hello"))
    assert set(allowed(so, [broken], V)[0].nonzero().flatten().tolist()) == set(so.eos_token_ids)


@pytest.mark.parametrize("schema", ['{"type": "strnig"}', "not json", '{"type": "object", "properties": 5}'])
def test_unusable_schema_is_refused_before_queueing(llm, schema):
    for param in ("response_format", "tools"):   # the request field the schema came from
        with pytest.raises(InvalidRequest) as err:
            llm.generate("Hi", SamplingParams(max_tokens=4, json_schema=schema,
                                              json_schema_param=param), use_tqdm=False)
        assert err.value.param == param and err.value.message.startswith(f"{param}: ")
        assert not llm.engine.requests
