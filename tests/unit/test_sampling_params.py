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
    ({"n": 0}, "n"),
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


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[3])
    p.validate(1000)
    assert p.stop == ("###",) and p.stop_token_ids == (3,)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
