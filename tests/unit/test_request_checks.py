"""Prompts the model cannot run (empty, token ids outside the vocabulary) are refused with one line naming why."""

import types

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from scheduler_patch import plugin, request_checks
from scheduler_patch.patches import PatchDriftError
from scheduler_patch.request_checks import prompt_problem

VOCAB = 8


@pytest.mark.parametrize("input_ids, expected", [
    ([], "the prompt is empty (0 tokens); send at least one token"),
    ([1, 2, 8], "input_ids[2] = 8 is not a token id of this model (vocabulary [0, 8))"),
    ([-1, 2], "input_ids[0] = -1 is not a token id of this model (vocabulary [0, 8))"),
    ([3, 10**6, -5], "input_ids[1] = 1000000 is not a token id of this model (vocabulary [0, 8))"),
    ([0], None),
    ([0, 7, 3], None),
])
def test_prompt_problem_names_the_first_bad_token(input_ids, expected):
    assert prompt_problem(input_ids, VOCAB) == expected


def _validate(obj, input_ids):
    """The patched validation on a tokenizer with an 8-token vocabulary; returns what the original was given."""
    tokenizer = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=VOCAB))
    seen = []
    request_checks._validate_one_request(lambda *args: seen.append(args), tokenizer, obj, input_ids)
    return seen


@pytest.mark.parametrize("obj, input_ids, complaint", [
    (GenerateReqInput(text=""), [], "the prompt is empty"),
    (GenerateReqInput(input_ids=[1, 9]), [1, 9], "input_ids[1] = 9"),
])
def test_a_bad_prompt_is_a_value_error_before_upstream_validation(obj, input_ids, complaint):
    with pytest.raises(ValueError, match=complaint.replace("[", r"\[")):
        _validate(obj, input_ids)


def test_a_good_prompt_goes_on_to_upstream_validation():
    obj = GenerateReqInput(input_ids=[1, 7])
    [(_, passed_obj, passed_ids)] = _validate(obj, [1, 7])
    assert passed_obj is obj and passed_ids == [1, 7]


@pytest.mark.parametrize("obj, input_ids", [
    (GenerateReqInput(input_embeds=[[0.0, 1.0]]), None),  # embeddings replace the ids
    (GenerateReqInput(text="<image>", image_data=["x.png"]), [99999]),  # placeholder ids of a multimodal prompt
])
def test_prompts_without_plain_token_ids_are_left_to_upstream(obj, input_ids):
    assert len(_validate(obj, input_ids)) == 1


def test_the_patch_is_registered_and_fits_the_pinned_sglang():
    assert request_checks.PROMPT_IDS in plugin.PATCHES
    assert request_checks._prompts_are_validated_here() is None


def test_validation_moving_upstream_is_drift(monkeypatch):
    target = f"{request_checks.TOKENIZER}._tokenize_one_request"
    monkeypatch.setitem(request_checks.VALIDATED, target, ("self._validate_one_request(obj, ids)",))
    assert target in request_checks._prompts_are_validated_here()
    with pytest.raises(PatchDriftError, match="dspark.prompt_ids"):
        request_checks.PROMPT_IDS.check()
