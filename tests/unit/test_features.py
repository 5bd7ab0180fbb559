"""Every request field SGLang 0.5.23 accepts is classified (served exactly / inert / refused), and refusal names
exactly the refused ones a request uses."""

import dataclasses
from types import SimpleNamespace

import msgspec
import pytest

from sgl_dspark.features import REFUSED, REQ_ATTRIBUTES, REQUEST_FIELDS, SAMPLING_FIELDS, refusal, used_refused


def test_every_sampling_params_field_is_classified():
    from sglang.srt.sampling.sampling_params import SamplingParams

    fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert sorted(fields - set(SAMPLING_FIELDS)) == []  # a new SGLang field: classify it in sgl_dspark.features
    assert sorted(set(SAMPLING_FIELDS) - fields) == []


def test_every_generate_request_field_is_classified():
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields = {f.name for f in dataclasses.fields(GenerateReqInput)}
    assert sorted(fields - set(REQUEST_FIELDS)) == []
    assert sorted(set(REQUEST_FIELDS) - fields) == []
    assert set(REQ_ATTRIBUTES.values()) <= {n for n, f in REQUEST_FIELDS.items() if f.kind == REFUSED}


def sglang_params(**given):
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SamplingParams(**given)


def test_defaults_and_served_fields_are_not_refused():
    params = sglang_params(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, stop=["\n"], max_new_tokens=9,
                           ignore_eos=True, n=1)
    assert refusal(params, SimpleNamespace(return_logprob=True, return_hidden_states=False)) is None
    assert refusal(sglang_params(sampling_seed=7), SimpleNamespace()) is None


@pytest.mark.parametrize("given", [{"frequency_penalty": 0.5, "presence_penalty": -0.3}, {"repetition_penalty": 1.2},
                                   {"min_new_tokens": 3}, {"regex": "[a-z]+"}, {"json_schema": "{}"}, {"ebnf": "x"},
                                   {"logit_bias": {"5": 1.0}}])
def test_constraints_and_penalties_are_served(given):
    """Served per verify row by sgl_dspark.constraints (greedy identity: tests/integration/test_dspark_constraints)."""
    assert refusal(sglang_params(**given), SimpleNamespace(custom_logit_processor="{}")) is None


@pytest.mark.parametrize("given,name", [({"watermark": {"key": "ab12"}}, "watermark"),
                                        ({"sampling_seed": 3, "min_p": 0.1}, "sampling_seed with min_p")])
def test_refused_sampling_fields_are_named(given, name):
    assert used_refused(sglang_params(**given), SimpleNamespace()) == [name]
    assert refusal(sglang_params(**given), SimpleNamespace()).startswith(f"DSPARK does not support {name} yet")


@pytest.mark.parametrize("attr", sorted(REQ_ATTRIBUTES))
def test_refused_request_attributes_are_named(attr):
    assert used_refused(sglang_params(), SimpleNamespace(**{attr: True})) == [REQ_ATTRIBUTES[attr]]
