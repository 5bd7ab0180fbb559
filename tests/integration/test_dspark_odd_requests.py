"""Odd and bad requests answer alike with and without DSPARK, and neither server goes down for them. Request
features DSPARK cannot serve exactly (sgl_dspark.features) are refused per request with one clear message naming
them; the server keeps serving."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from conftest import generate

pytestmark = pytest.mark.integration

PROMPT = "def add(a, b):\n"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@dataclass(frozen=True)
class Odd:
    name: str
    body: dict
    path: str = "/generate"
    status: int | None = None  # what both must answer; None: whatever the plain server answers
    same_text: bool = False  # greedy: the reply text must match too


def sampled(**params) -> dict:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, **params}}


def odd_requests(context_len: int) -> list[Odd]:
    return [
        Odd("negative max_new_tokens", sampled(max_new_tokens=-1)),
        Odd("huge max_new_tokens", sampled(max_new_tokens=10**9)),
        Odd("max_new_tokens 0", sampled(temperature=0, max_new_tokens=0), same_text=True),
        Odd("temperature -1", sampled(temperature=-1)),
        Odd("temperature 1e-7", sampled(temperature=1e-7), status=200),
        Odd("temperature 5e-6", sampled(temperature=5e-6), status=200),
        Odd("temperature 2e-5", sampled(temperature=2e-5), status=200),
        Odd("top_p 0", sampled(top_p=0)),
        Odd("top_p 1.5", sampled(top_p=1.5)),
        Odd("top_k 0", sampled(top_k=0)),
        Odd("top_k -5", sampled(top_k=-5)),
        Odd("n=2", sampled(n=2, temperature=0.8)),
        Odd("stop at newline", sampled(temperature=0, max_new_tokens=32, stop=["\n"]), status=200, same_text=True),
        Odd("prompt over the context length", {"input_ids": [1] * (context_len + 1), "sampling_params": GREEDY}),
        Odd("empty text", {"text": "", "sampling_params": GREEDY}, status=400),
        Odd("empty input_ids", {"input_ids": [], "sampling_params": GREEDY}, status=400),
        Odd("input_ids beyond the vocabulary", {"input_ids": [1, 2, 10**6], "sampling_params": GREEDY}, status=400),
        Odd("negative input_ids", {"input_ids": [1, -2, 3], "sampling_params": GREEDY}, status=400),
        Odd("batch with an empty text", {"text": [PROMPT, ""], "sampling_params": GREEDY}, status=400),
        Odd("/v1/completions empty prompt", {"model": "default", "prompt": "", "max_tokens": 8}, "/v1/completions",
            status=400),
        Odd("/v1/completions ids beyond the vocabulary", {"model": "default", "prompt": [1, 10**6], "max_tokens": 8},
            "/v1/completions", status=400),
        Odd("/v1/chat/completions no messages", {"model": "default", "messages": [], "max_tokens": 8},
            "/v1/chat/completions", status=400),
    ]


def answer(base_url: str, odd: Odd) -> tuple[str, str]:
    """(status, detail): the HTTP status, or why there was none; the error message or the reply text."""
    try:
        reply = requests.post(f"{base_url}{odd.path}", json=odd.body, timeout=300)
    except requests.RequestException as e:
        return f"no answer ({type(e).__name__})", ""
    return str(reply.status_code), detail(reply)


def detail(reply: requests.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:80]
    if isinstance(body, list):
        body = body[0]
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else body.get("message", body.get("text", ""))
    return " ".join(str(message).split())[:100]


def table(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


@pytest.fixture(scope="module")
def context_len(default_model_path) -> int:
    return json.loads((Path(default_model_path) / "config.json").read_text())["max_position_embeddings"]


def test_odd_requests_answer_alike_with_and_without_dspark(plain_server, dspark_server, context_len):
    lines, wrong = [("request", "plain", "dspark", "expected", "plain says", "dspark says")], []
    for odd in odd_requests(context_len):
        (plain, plain_says), (dspark, dspark_says) = (answer(s.base_url, odd) for s in (plain_server, dspark_server))
        expected = str(odd.status) if odd.status else plain
        if {plain, dspark} != {expected} or (odd.same_text and plain_says != dspark_says):
            wrong.append(odd.name)
        lines.append((odd.name, plain, dspark, expected, repr(plain_says), repr(dspark_says)))
    assert not wrong, f"{wrong} answered differently:\n{table(lines)}"


def test_both_servers_still_serve_alike_afterwards(plain_server, dspark_server):
    plain, dspark = (generate(s.base_url, "The capital of France is", temperature=0, max_new_tokens=16)
                     for s in (plain_server, dspark_server))
    assert dspark["output_ids"] == plain["output_ids"] and plain["meta_info"]["completion_tokens"] == 16


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
