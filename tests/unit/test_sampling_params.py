"""SamplingParams.validate: every out-of-range value is an InvalidRequest naming its field."""
import pytest

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
])
def test_invalid_values_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs).validate(vocab_size=1000)
    assert err.value.param == param
    assert err.value.to_dict()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("n", [0, -1, 129, 2.0, True])
def test_check_n_rejects_what_cannot_fan_out(n):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(n=n).check_n()
    assert err.value.param == "n"


def test_check_n_accepts_the_range_and_validate_leaves_n_to_it():
    for n in (1, 2, 128):
        SamplingParams(n=n).check_n()
    bad = SamplingParams(n=0)
    bad.validate(1000)  # the engine sees only n=1 children: n is check_n's alone
    with pytest.raises(InvalidRequest):
        bad.check_n()


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[3])
    p.validate(1000)
    assert p.stop == ("###",) and p.stop_token_ids == (3,)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
