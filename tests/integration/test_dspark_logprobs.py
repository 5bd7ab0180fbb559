"""Log probabilities through DSPARK equal plain decoding's: /generate `return_logprob` with `top_logprobs_num`,
`token_ids_logprob` and `logprob_start_len`, and the OpenAI `logprobs` / `top_logprobs` of /v1/completions and
/v1/chat/completions. Same tokens; values within LOGPROB_TOL (float32: the verify forward computes several rows in
one GEMM where plain decoding computes one, so the logits round differently in the last bits).

Against `chain_server` (the bigram drafter, conftest): most verify steps accept multi-token blocks, so the values
come from the rows of accepted paths, not only from the anchor's row.
"""

import openai
import pytest
import requests

pytestmark = pytest.mark.integration

LOGPROB_TOL = 2e-3
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
ASK = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
CHAT = [{"role": "user", "content": "List three prime numbers and say why they are prime."}]


def ask(server, **extra) -> dict:
    body = {"text": PROMPT, "sampling_params": ASK, "return_logprob": True, **extra}
    reply = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def close(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, (list, tuple)):
            close(list(x), list(y), f"{what}[{i}]")
        elif isinstance(x, float) or isinstance(y, float):
            assert x == pytest.approx(y, abs=LOGPROB_TOL), f"{what}[{i}]: {x} vs {y}"
        else:
            assert x == y, f"{what}[{i}]: {x} vs {y}"


def test_generate_logprobs_equal_plain(plain_server, chain_server):
    extra = {"top_logprobs_num": 3, "token_ids_logprob": [13, 198, 262], "logprob_start_len": 4}
    plain, ours = ask(plain_server, **extra), ask(chain_server, **extra)
    assert ours["output_ids"] == plain["output_ids"]
    assert ours["meta_info"]["spec_num_correct_drafts"] > 0  # accepted drafts' rows gave logprobs too
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "input_token_logprobs", "input_top_logprobs"):
        close(ours["meta_info"][key], plain["meta_info"][key], key)
    assert len(ours["meta_info"]["output_token_logprobs"]) == ASK["max_new_tokens"]


def test_sampled_requests_get_one_logprob_per_token(chain_server):
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32, "ignore_eos": True}}
    reply = requests.post(f"{chain_server.base_url}/generate", json=body, timeout=600).json()
    logprobs = reply["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == reply["output_ids"]
    assert all(v <= 0.0 for v, _, _ in logprobs)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)


def test_openai_completions_logprobs_equal_plain(plain_server, chain_server):
    def run(server):
        out = client(server).completions.create(model="default", prompt=PROMPT, max_tokens=32, temperature=0,
                                                logprobs=3)
        return out.choices[0].logprobs

    plain, ours = run(plain_server), run(chain_server)
    assert ours.tokens == plain.tokens
    close(ours.token_logprobs, plain.token_logprobs, "token_logprobs")
    assert [sorted(d) for d in ours.top_logprobs] == [sorted(d) for d in plain.top_logprobs]


def test_openai_chat_logprobs_equal_plain(plain_server, chain_server):
    def run(server):
        out = client(server).chat.completions.create(model="default", messages=CHAT, max_tokens=32, temperature=0,
                                                     logprobs=True, top_logprobs=2)
        return out.choices[0].logprobs.content

    plain, ours = run(plain_server), run(chain_server)
    assert [t.token for t in ours] == [t.token for t in plain]
    close([t.logprob for t in ours], [t.logprob for t in plain], "logprob")
    assert [[a.token for a in t.top_logprobs] for t in ours] == [[a.token for a in t.top_logprobs] for t in plain]
