import dataclasses
import math

import pytest

from tokenmill.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.logit_bias is None and p.seed is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        (dict(n=0), "n", "n must be >= 1, got 0"),
        (dict(n=1.5), "n", "n must be an integer, got 1.5"),
        (dict(n=True), "n", "n must be an integer, got True"),
        (dict(temperature=-1), "temperature", "temperature must be >= 0, got -1.0"),
        (dict(temperature=math.nan), "temperature", "temperature must be >= 0, got nan"),
        (dict(temperature=math.inf), "temperature", "temperature must be >= 0, got inf"),
        (dict(temperature="1"), "temperature", "temperature must be a number, got '1'"),
        (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=1.01), "top_p", "top_p must be in (0, 1], got 1.01"),
        (dict(top_k=-2), "top_k", "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
        (dict(top_k=2.0), "top_k", "top_k must be an integer, got 2.0"),
        (dict(min_p=-0.1), "min_p", "min_p must be in [0, 1], got -0.1"),
        (dict(min_p=1.5), "min_p", "min_p must be in [0, 1], got 1.5"),
        (dict(repetition_penalty=0), "repetition_penalty", "repetition_penalty must be > 0, got 0.0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty", "must be > 0, got -1.0"),
        (dict(frequency_penalty=2.5), "frequency_penalty", "frequency_penalty must be in [-2, 2], got 2.5"),
        (dict(frequency_penalty=-2.1), "frequency_penalty", "must be in [-2, 2], got -2.1"),
        (dict(presence_penalty=-3), "presence_penalty", "presence_penalty must be in [-2, 2], got -3.0"),
        (dict(presence_penalty=2.01), "presence_penalty", "must be in [-2, 2], got 2.01"),
        (dict(logit_bias={5: 101}), "logit_bias", "logit_bias[5] must be in [-100, 100], got 101"),
        (dict(logit_bias={5: -100.5}), "logit_bias", "logit_bias[5] must be in [-100, 100], got -100.5"),
        (dict(logit_bias={5: math.nan}), "logit_bias", "logit_bias[5] must be in [-100, 100], got nan"),
        (dict(logit_bias={-1: 1.0}), "logit_bias", "logit_bias keys must be token ids >= 0, got -1"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias", "keys must be token ids >= 0, got 'abc'"),
        (dict(logit_bias={5: "x"}), "logit_bias", "logit_bias[5] must be a number, got 'x'"),
        (dict(logit_bias=[1, 2]), "logit_bias", "logit_bias must map token ids to numbers"),
        (dict(seed=1.0), "seed", "seed must be an integer, got 1.0"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
        (dict(min_tokens=-1), "min_tokens", "min_tokens must be >= 0, got -1"),
        (dict(min_tokens=17), "min_tokens", "min_tokens must be <= max_tokens (16), got 17"),
        (dict(stop=""), "stop", "stop must contain only non-empty strings, got ''"),
        (dict(stop=["a", ""]), "stop", "stop must contain only non-empty strings, got ''"),
        (dict(stop=["a", 3]), "stop", "stop must contain only non-empty strings, got 3"),
        (dict(stop=3), "stop", "stop must be a string or a list of strings, got 3"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids", "stop_token_ids must contain integer token ids >= 0, got -2"),
        (dict(stop_token_ids=5), "stop_token_ids", "stop_token_ids must be a list of token ids, got 5"),
        (dict(ignore_eos=1), "ignore_eos", "ignore_eos must be true or false, got 1"),
        (dict(logprobs=-1), "logprobs", "logprobs must be in [0, 20], got -1"),
        (dict(logprobs=21), "logprobs", "logprobs must be in [0, 20], got 21"),
        (dict(skip_special_tokens="yes"), "skip_special_tokens", "must be true or false, got 'yes'"),
        (dict(include_stop_str_in_output=None), "include_stop_str_in_output", "must be true or false, got None"),
    ],
)
def test_bad_values_name_field_value_and_range(kwargs, field, message):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=4),
        dict(temperature=0),
        dict(temperature=2.5),
        dict(top_p=1e-6),
        dict(top_p=1),
        dict(top_k=-1),
        dict(top_k=1),
        dict(top_k=100_000),
        dict(min_p=0),
        dict(min_p=1),
        dict(repetition_penalty=1e-3),
        dict(repetition_penalty=5),
        dict(frequency_penalty=-2, presence_penalty=2),
        dict(logit_bias={0: -100, 7: 100}),
        dict(logit_bias={}),
        dict(seed=-5),
        dict(seed=2**70),
        dict(max_tokens=None, min_tokens=10_000),
        dict(max_tokens=5, min_tokens=5),
        dict(stop=["a", "bc"]),
        dict(stop_token_ids=[0, 7]),
        dict(logprobs=0),
        dict(logprobs=20),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_numbers_are_normalised_to_float():
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, frequency_penalty=1)
    assert type(p.temperature) is float and type(p.top_p) is float
    assert type(p.repetition_penalty) is float and type(p.frequency_penalty) is float


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_logit_bias_accepts_json_string_keys():
    p = SamplingParams(logit_bias={"5": 1, 6: -2.5})
    assert p.logit_bias == {5: 1.0, 6: -2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert SamplingParams(temperature=1e-7).greedy  # would overflow fp32 when dividing logits
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, seed=3).seed == 3
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(p, top_p=0)
