"""Field case C60: GLM-4.5, GLM-4.7 and GLM-5 chat templates (tests/api/glm_templates.py) render OpenAI-shaped tool
history. A request's messages go through the server's seam (ChatCompletionRequest -> template_dict) and must render
exactly as the template applied to normalised messages (arguments as objects, text parts joined): call arguments as
a JSON string, an object, "" or "{}"; tool content as a string, text parts or empty; 2-5 messages; with and
without tools. Arguments that are not a JSON object are refused at parse time (a 400; over HTTP: test_api_glm5.py);
Tokenizer.apply_chat_template (router, LLM.chat) normalises raw messages the same way."""
from __future__ import annotations

import copy
import itertools
import json

import pytest

from radixserve.errors import InvalidRequest
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.validation import validation_error
from radixserve.tokenizer.tokenizer import Tokenizer
from tests.api.glm_templates import TEMPLATES, glm_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "where": {"type": "object"}}}}}
ARGS = {"city": "Zürich <b>", "days": 2, "where": {"lat": 47.4, "tags": ["a", "b"]}}
RESULT = 'Sunny, 24 °C <tool_response> & {"t": 24}\nline 2'
# arguments as sent -> as the template must see them
ARG_FORMS = {"json_text": (json.dumps(ARGS), ARGS), "object": (ARGS, ARGS), "spaced_text": (json.dumps(ARGS, indent=2), ARGS),
             "empty": ("", {}), "empty_object_text": ("{}", {}), "blank": ("  ", {})}
# tool content as sent -> as the template must see it
CONTENT_FORMS = {"string": (RESULT, RESULT),
                 "parts": ([{"type": "text", "text": RESULT[:9]}, {"type": "text", "text": RESULT[9:]}], RESULT),
                 "empty": ("", ""), "none": (None, ""), "no_parts": ([], "")}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def glm(request, default_tokenizer) -> Tokenizer:
    return Tokenizer(glm_tokenizer(default_tokenizer.hf, TEMPLATES[request.param]))


def call(args, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}


def history(num_messages: int, args, content) -> list[dict]:
    """2-5 messages of one tool round: user, assistant with a call (two from 5 on), its results."""
    msgs = [{"role": "system", "content": "Use tools."}] if num_messages >= 4 else []
    calls = [call(args)] + ([call(copy.deepcopy(args), "call_2")] if num_messages == 5 else [])
    msgs += [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "Checking." if num_messages % 2 else None, "tool_calls": calls}]
    msgs += [{"role": "tool", "tool_call_id": c["id"], "content": copy.deepcopy(content)} for c in calls
             if num_messages >= 3]
    return msgs


def served(glm: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text the server renders for this body (the seam chat.py uses)."""
    req = ChatCompletionRequest.model_validate_json(json.dumps({"messages": messages}))
    return glm.render_chat([m.template_dict() for m in req.messages], tools=tools)


@pytest.mark.parametrize("num_messages, tools", list(itertools.product([2, 3, 4, 5], [None, [WEATHER]])))
def test_every_form_renders_as_the_normalised_history(glm, num_messages, tools):
    for (arg_name, (args, norm_args)), (content_name, (content, norm_content)) in itertools.product(
            ARG_FORMS.items(), CONTENT_FORMS.items()):
        if content_name != "string" and num_messages < 3:
            continue                         # no tool message to vary
        text = served(glm, history(num_messages, args, content), tools)
        assert text == glm.render_chat(history(num_messages, norm_args, norm_content), tools=tools), \
            (arg_name, content_name)
        if num_messages >= 3 and norm_content:
            assert RESULT in text, content_name                         # verbatim, for string and parts
        if norm_args:
            assert "<arg_value>Zürich <b></arg_value>" in text and '{"lat": 47.4, "tags": ["a", "b"]}' in text


def test_json_text_and_object_arguments_give_byte_identical_prompts(glm):
    text = served(glm, history(5, json.dumps(ARGS), RESULT), [WEATHER])
    assert text == served(glm, history(5, ARGS, RESULT), [WEATHER])
    assert glm.apply_chat_template(history(5, ARGS, RESULT), tools=[WEATHER]) == glm.hf.encode(
        text, add_special_tokens=False)


def test_every_tokenizer_caller_gets_the_same_normalisation(glm):
    """GLM templates iterate arguments.items(), so the JSON text OpenAI clients send fails in the raw template (C60's
    source bug); Tokenizer.apply_chat_template, which the router's route key and LLM.chat call on raw messages,
    normalises as the server does: the same ids as the object form, and a 400 for arguments that are not an object."""
    with pytest.raises(Exception, match="items"):
        glm.hf.apply_chat_template(history(3, json.dumps(ARGS), RESULT), tokenize=False)
    parts = [{"type": "text", "text": RESULT[:9]}, {"type": "text", "text": RESULT[9:]}]
    assert glm.apply_chat_template(history(5, json.dumps(ARGS), parts)) == glm.apply_chat_template(
        history(5, ARGS, RESULT))
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: .*an array"):
        glm.apply_chat_template(history(3, "[1]", RESULT))


@pytest.mark.parametrize("args, says", [("{oops", "not JSON"), ('{"city": "Paris"', "not JSON"),
                                        ("[1, 2]", "an array"), ("null", "null"), ('"x"', "a string"),
                                        ("12", "a number"), ("true", "a boolean"), ("[" * 100_000, "not JSON")])
def test_arguments_that_are_not_a_json_object_are_a_400(args, says):
    body = json.dumps({"messages": history(3, args, RESULT)})
    with pytest.raises(Exception) as err:
        ChatCompletionRequest.model_validate_json(body)
    bad = validation_error(err.value)
    assert bad.status == 400 and bad.param == "messages.1.tool_calls.0.function.arguments", bad.message
    assert "arguments must be a JSON object" in bad.message and says in bad.message
