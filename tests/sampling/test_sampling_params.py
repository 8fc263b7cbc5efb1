"""Invalid sampling parameters raise `InvalidRequest` naming the field."""

from __future__ import annotations

import pytest

from nextoken.errors import InvalidRequest
from nextoken.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"logit_bias": {999999: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs).validate(vocab_size=1000)
    assert e.value.field == field
    assert field.split("[")[0] in str(e.value)


def test_valid_defaults_and_stop_string():
    p = SamplingParams(stop="END").validate(1000)
    assert p.stop == ["END"] and not p.greedy
    assert SamplingParams(temperature=0).greedy
