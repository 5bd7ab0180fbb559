"""Request features DSPARK cannot serve exactly (sgl_dspark.features) are refused per request with one clear
message naming them; the server keeps serving."""

import pytest
import requests

from conftest import generate


@pytest.mark.parametrize("params,name", [({"sampling_seed": 3, "min_p": 0.1}, "sampling_seed with min_p")])
def test_unsupported_sampling_params_are_refused_by_name(dspark_server, params, name):
    reply = requests.post(f"{dspark_server.base_url}/generate", timeout=120,
                          json={"text": "Hello", "sampling_params": {"max_new_tokens": 8, **params}})
    assert reply.status_code == 400
    assert f"DSPARK does not support {name}" in reply.json()["error"]["message"]


def test_hidden_states_requests_are_refused(dspark_server):
    """DSPARK refuses --enable-return-hidden-states at start-up (tests/unit/test_patches.py), so SGLang's own check
    answers the request: a 400 naming hidden states, and the server serves on."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8}, "return_hidden_states": True}
    reply = requests.post(f"{dspark_server.base_url}/generate", timeout=120, json=body)
    assert reply.status_code == 400 and "hidden states" in reply.json()["error"]["message"]


def test_server_keeps_serving_after_a_refusal(dspark_server):
    reply = generate(dspark_server.base_url, "Hello", max_new_tokens=4, temperature=0)
    assert reply["meta_info"]["completion_tokens"] == 4
