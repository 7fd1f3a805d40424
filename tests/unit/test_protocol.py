"""OpenAI request schemas: accepted shapes, strict types, sampling-param mapping, bounded errors."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from radixserve.errors import InvalidRequest
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.validation import render_details, validation_error


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


def error_of(cls, body: str) -> InvalidRequest:
    with pytest.raises(ValidationError) as err:
        cls.model_validate_json(body)
    return validation_error(err.value)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [], [[]]])
def test_prompt_shapes(prompt):
    assert CompletionRequest.model_validate_json(json.dumps({"prompt": prompt})).prompt == prompt


def test_defaults():
    req = completion()
    assert req.max_tokens == 16 and req.n == 1 and not req.stream and not req.echo
    chat = ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}]}')
    assert chat.max_tokens is None and chat.max_completion_tokens is None and not chat.include_usage


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "max_tokens": "10"}', "max_tokens"),
    ('{"prompt": "x", "stream": "yes"}', "stream"),
    ('{"prompt": {"a": 1}}', "prompt"),
    ('{"prompt": "x", "stop": 5}', "stop"),
    ('{"prompt": "x", "n": 1.5}', "n"),
    ('{}', "prompt"),
    ('not json', None),
    ('{"prompt": "x"', None),
])
def test_completion_type_errors(body, param):
    err = error_of(CompletionRequest, body)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert (err.param or "").split(".")[0] == (param or "")


@pytest.mark.parametrize("body", [
    '{"messages": []}',
    '{"messages": "hi"}',
    '{"messages": [{"role": "user", "content": 5}]}',
    '{"messages": [{"role": "robot", "content": "x"}]}',
    '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
])
def test_chat_shape_errors(body):
    assert error_of(ChatCompletionRequest, body).param.startswith("messages")


def test_content_parts_join():
    chat = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        ' {"type": "text", "text": "b"}]}]}')
    assert chat.messages[0].text() == "ab"


def test_error_body_is_bounded_for_huge_inputs():
    big = json.dumps({"messages": [{"role": "robot", "content": "x" * 1000}] * 5000})
    err = error_of(ChatCompletionRequest, big)
    assert len(json.dumps(err.to_dict())) < 4096
    assert "4997 more errors" in err.message and "xxxx" not in err.message


def test_render_details_without_errors():
    assert render_details([]) == ("invalid request body", None)


def test_sampling_params_mapping():
    req = completion(temperature=0, top_p=0.5, stop="END", seed=3, top_k=5, min_p=0.1,
                     repetition_penalty=1.1, stop_token_ids=[7], ignore_eos=True, min_tokens=2,
                     include_stop_str_in_output=True, skip_special_tokens=False)
    p = req.sampling_params(12, 2, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.0, 0.5, 5, 0.1, 3)
    assert p.stop == ("END",) and p.stop_token_ids == (7,) and p.ignore_eos and p.min_tokens == 2
    assert p.max_tokens == 12 and p.logprobs == 2 and p.prompt_logprobs is None
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert completion().sampling_params(16, None, None).temperature == 1.0


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"), ({"stop": [""]}, "stop"), ({"logprobs": 50}, "logprobs"),
])
def test_out_of_range_fields_keep_their_name_for_the_engine_check(fields, param):
    """Building params checks no ranges (the engine's add_request does, via validate, and the
    fan-out checks n); each bad field is then reported under its own name."""
    req = completion(**fields)
    params = req.sampling_params(req.max_tokens, req.logprobs, None)
    with pytest.raises(InvalidRequest) as err:
        params.check_n()
        params.validate(vocab_size=1000)
    assert err.value.param == param


def test_logit_bias_keys_become_token_ids():
    req = completion(logit_bias={"1": 2.0, "17": -100})
    assert req.sampling_params(req.max_tokens, req.logprobs, None).logit_bias == ((1, 2.0), (17, -100.0))
    req = completion(logit_bias={"one": 2.0})
    with pytest.raises(InvalidRequest) as err:
        req.sampling_params(req.max_tokens, req.logprobs, None)
    assert err.value.param == "logit_bias"


# ---- wire bounds (issue 11): integers the engine process can be sent --------------------------
INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("fields, param", [
    ({"seed": 18446744073709551616}, "seed"), ({"seed": INT64_MAX + 1}, "seed"),
    ({"seed": -INT64_MAX - 2}, "seed"), ({"top_k": 2**64}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 2**64}, "n"), ({"max_tokens": 2**64}, "max_tokens"), ({"min_tokens": -2**64}, "min_tokens"),
    ({"logprobs": 2**64}, "logprobs"), ({"prompt": [1, 2**64]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"), ({"prompt": [2**31]}, "prompt"),
])
def test_integers_beyond_the_wire_are_400_at_the_schema(fields, param):
    err = error_of(CompletionRequest, json.dumps({"prompt": "hi", **fields}))
    assert err.status == 400 and (err.param or "").split(".")[0] == param


@pytest.mark.parametrize("fields", [
    {"top_k": 2**64}, {"seed": 2**64}, {"max_completion_tokens": 2**64}, {"top_logprobs": 2**64},
    {"stop_token_ids": [2**64]}, {"max_tokens": -2**64},
])
def test_chat_integers_beyond_the_wire_are_400(fields):
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    err = error_of(ChatCompletionRequest, json.dumps(body))
    assert err.param.split(".")[0] == next(iter(fields))


def test_wire_bound_edges_are_accepted():
    req = completion(seed=INT64_MAX, top_k=2**31 - 1, stop_token_ids=[0, 2**31 - 1],
                     max_tokens=INT64_MAX, prompt=[0, 2**31 - 1])
    assert req.seed == INT64_MAX and completion(seed=-INT64_MAX - 1, top_k=-1).seed == -2**63


def test_resumed_params_reduce_limits_and_refuse_what_cannot_continue_exactly():
    from radixserve.server.resume import resumed_params

    def params(**fields):
        req = completion(resume_token_ids=[5, 6, 7], **fields)
        return resumed_params(req, req.sampling_params(req.max_tokens, req.logprobs, None), 1)

    p = params(max_tokens=10, min_tokens=4)
    assert (p.max_tokens, p.min_tokens) == (7, 1)
    assert params(max_tokens=10, min_tokens=2).min_tokens == 0
    for bad in ({"n": 2}, {"echo": True}, {"logprobs": 1}, {"frequency_penalty": 0.5},
                {"presence_penalty": 0.5}, {"max_tokens": 3}):
        with pytest.raises(InvalidRequest) as err:
            params(**bad)
        assert err.value.param == "resume_token_ids"
