"""A tiny GLM-5-shaped model (glm_moe_dsa: MLA + DSA, index_topk 8) served with a GLM-5-format chat template
(tests/api/glm_templates.py), the glm47 tool parser, the glm45 reasoning parser and n-gram speculation, through
`radixserve serve` and the `openai` client (issue 40): a two-turn tool conversation (replies forced with
sampler.force_tokens, which random weights cannot write), C60's history forms over HTTP, json_schema output,
reasoning, and n-gram speculation's greedy tokens equal to transformers' with drafts proposed, kept and rejected."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from radixserve.tokenizer.tokenizer import Tokenizer
from tests.api.glm_templates import glm5_model_dir
from tests.api.streams import post_stream
from tests.api.tool_fixtures import (TOOLS, chat, force, full_message, parser_server, same_reply, stream,
                                     streamed_message)
from tests.model.parity import assert_parity, hf_greedy

QUESTION = [{"role": "system", "content": "Use tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
ARGS = {"city": "Paris", "days": 2}       # "2" typed per the schema (integer)
RESULT = "Sunny, 24 C"
END = "<|observation|>"                   # GLM ends a reply that calls with <|observation|> (an eos)


@pytest.fixture(scope="module")
def model_dir(default_tokenizer, tmp_path_factory):
    return glm5_model_dir(default_tokenizer.hf, tmp_path_factory.mktemp("glm5") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.load(str(model_dir))


@pytest.fixture(scope="module")
def server(request, model_dir):
    yield from parser_server(request, ["--tool-call-parser", "glm47", "--reasoning-parser", "glm45",
                                       "--speculative-algorithm", "ngram"], model_dir)


def test_openai_client_two_turn_tool_conversation(server, tokenizer):
    client = server.client()
    force(server, tokenizer, "The user wants Paris.</think>Let me check." + CALL, end=END)
    first = client.chat.completions.create(model=server.model, messages=QUESTION, tools=TOOLS,
                                           max_tokens=100, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants Paris."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    prompt = tokenizer.render_chat(QUESTION, tools=TOOLS)
    assert prompt.endswith("<|user|>What is the weather in Paris?<|assistant|><think>")
    assert first.usage.prompt_tokens == len(tokenizer.apply_chat_template(QUESTION, tools=TOOLS))

    result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
    turn_two = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    force(server, tokenizer, "It worked.</think>It is sunny in Paris, 24 C.", end="<|endoftext|>")
    second = client.chat.completions.create(model=server.model, messages=turn_two, tools=TOOLS,
                                            max_tokens=100, temperature=0)
    msg = second.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("It worked.", "It is sunny in Paris, 24 C.")
    assert second.choices[0].finish_reason == "stop" and not msg.tool_calls
    # The template saw the call's arguments as an object (its tags), its reasoning (this tool round) and the result.
    expected = [*QUESTION, {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants Paris.",
                            "tool_calls": [{"id": call.id, "type": "function",
                                            "function": {"name": "get_weather", "arguments": ARGS}}]}, result]
    assert tokenizer.render_chat(expected, tools=TOOLS).endswith(
        "<|assistant|><think>The user wants Paris.</think>Let me check." + CALL
        + "<|observation|><tool_response>Sunny, 24 C</tool_response><|assistant|><think>")
    assert second.usage.prompt_tokens == len(tokenizer.apply_chat_template(expected, tools=TOOLS))


def test_streamed_glm5_reply_equals_the_full_one(server, tokenizer):
    """Thinking, text and two calls in GLM-5's layout, streamed and not: the same message (C43 on this format)."""
    force(server, tokenizer, "Two cities.</think>Checking." + CALL + CALL.replace("Paris", "Rome"), count=2, end=END)
    full = full_message(chat(server, messages=QUESTION, tools=TOOLS))
    same_reply(streamed_message(stream(server, messages=QUESTION, tools=TOOLS)), full)
    assert (full["reasoning"], full["content"], full["finish_reason"]) == ("Two cities.", "Checking.", "tool_calls")
    assert [json.loads(c["arguments"])["city"] for c in full["calls"]] == ["Paris", "Rome"]


def history(args, content) -> list[dict]:
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": content}]


def test_c60_history_forms_render_as_normalised(server, tokenizer):
    """(a) JSON text and (b) object arguments give the same prompt; "" and "{}" render as {}; tool content as a
    string, text parts or empty; each prompt_tokens is the normalised history's, with and without tools."""
    forms = [(json.dumps(ARGS), ARGS), (ARGS, ARGS), ("", {}), ("{}", {})]
    contents = [(RESULT, RESULT), ([{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24 C"}], RESULT),
                ("", "")]
    for tools in (TOOLS, None):
        for (args, norm_args), (content, norm_content) in [(f, c) for f in forms for c in contents]:
            body = chat(server, messages=history(args, content), max_tokens=1,
                        **({"tools": tools} if tools else {}))
            ref = tokenizer.apply_chat_template(history(norm_args, norm_content), tools=tools)
            assert body["usage"]["prompt_tokens"] == len(ref), (args, content, tools)


@pytest.mark.parametrize("args", ["{oops", "[1, 2]", "null"])
def test_c60_arguments_not_a_json_object_are_a_400(server, args):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model=server.model, messages=history(args, RESULT), max_tokens=1)
    error = err.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == "messages.2.tool_calls.0.function.arguments" and error["code"] == 400
    assert "arguments must be a JSON object" in error["message"]


def test_json_schema_output_is_valid_json_content(server):
    """The grammar holds from the first token, so the GLM-5 prompt's open <think> does not make the JSON reasoning."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}}
    msg = chat(server, messages=QUESTION, max_tokens=60, temperature=0, response_format=fmt)["choices"][0]["message"]
    jsonschema.validate(json.loads(msg["content"]), schema)
    assert msg["reasoning_content"] is None


def test_reasoning_parser_splits_thinking(server, tokenizer):
    reply = "Paris is in France.</think>It is sunny."
    num_tokens = force(server, tokenizer, reply, count=2, end="<|endoftext|>")
    full = chat(server, messages=QUESTION)
    msg = full["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Paris is in France.", "It is sunny.")
    assert full["usage"]["completion_tokens"] == num_tokens
    assert 0 < full["usage"]["completion_tokens_details"]["reasoning_tokens"] < num_tokens
    off = chat(server, messages=QUESTION, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert (off["reasoning_content"], off["content"]) == (None, reply)      # the prompt closed thinking


@torch.inference_mode()
def test_ngram_speculation_keeps_greedy_tokens(server, model_dir, tokenizer):
    """A repetitive prompt asked twice, then with its last token changed: the second answer is drafted from the first
    (n-gram's shared table), the third partly; every answer is transformers' greedy continuation."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = tokenizer.hf.encode(" alpha beta gamma delta epsilon" * 8, add_special_tokens=False)
    drafted = accepted = 0
    for prompt in (base, base, base[:-1] + [base[-1] + 2]):
        res = post_stream(server.http, "/v1/completions", {
            "model": server.model, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}})
        ours = [t for chunk in res.chunks for c in chunk["choices"] for t in c.get("token_ids") or []]
        ref, logits = hf_greedy(hf, prompt, 40)
        assert_parity(ours, ref, logits, "ngram")
        drafted += res.usage.get("spec_draft_tokens", 0)
        accepted += res.usage.get("spec_accepted_tokens", 0)
    assert drafted > accepted > 0, (drafted, accepted)
