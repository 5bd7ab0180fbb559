"""SGLang's builtin NGRAM speculative decoding served on CPU through the dspark_torch attention backend:
greedy output token-identical to the plain server (float32), with drafts actually accepted."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from scheduler_patch.backends import TORCH_BACKEND
from sgl_dspark.tools.launch import ServerSpec, free_port, serving

pytestmark = pytest.mark.integration

NGRAM_ARGS = ("--speculative-algorithm", "NGRAM", "--attention-backend", TORCH_BACKEND,
              "--speculative-num-draft-tokens", "8")
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n    return x + 3\n\n",
    "A B C D A B C D A B C D A B C D A B",
    "The capital of France is",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def ngram_server(default_model_path, tmp_path_factory):
    spec = ServerSpec(default_model_path, port=free_port(), speculative_args=NGRAM_ARGS)
    with serving(spec, tmp_path_factory.mktemp("ngram")) as server:
        yield server


def generate(server, prompt: str) -> dict:
    body = {"text": prompt, "sampling_params": GREEDY}
    reply = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()


@pytest.fixture(scope="module")
def plain_outputs(plain_server):
    return [generate(plain_server, p)["output_ids"] for p in PROMPTS]


def test_ngram_is_token_identical_to_plain_decoding(ngram_server, plain_outputs):
    replies = [generate(ngram_server, p) for p in PROMPTS]
    for prompt, reply, want in zip(PROMPTS, replies, plain_outputs):
        assert reply["output_ids"] == want, prompt
        assert reply["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    accept_lengths = [r["meta_info"]["spec_accept_length"] for r in replies]
    verify_counts = [r["meta_info"]["spec_verify_ct"] for r in replies]
    assert max(accept_lengths) > 1.5, accept_lengths  # NGRAM drafted and the tree verify accepted drafts
    assert min(verify_counts) > 0 and sum(verify_counts) < len(PROMPTS) * GREEDY["max_new_tokens"], verify_counts


def test_ngram_batched_requests_match_plain_decoding(ngram_server, plain_outputs):
    """Concurrent requests share verify batches (several requests per TARGET_VERIFY forward)."""
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: generate(ngram_server, p), PROMPTS))
    for prompt, reply, want in zip(PROMPTS, replies, plain_outputs):
        assert reply["output_ids"] == want, prompt
