"""SGLang's APIs served through DSPARK answer as the plain server does (greedy): /generate streaming, the OpenAI
/v1/completions and /v1/chat/completions (plain and streamed), a frontend-language program, stop strings,
max_tokens 1 and 2, and EOS finishing.

All against `chain_server`: DSPARK as configured by default, with the bigram drafter (conftest), so verify steps
accept multi-token blocks and stops, length caps and EOS land inside a block, where the server must cut it.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from conftest import generate, generate_all

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0}
CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"  # one of the 20 prompts
STORY_PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "system", "content": "You are a careful assistant. Answer briefly and precisely, and show your "
                                      "reasoning in at most three steps."},
        {"role": "user", "content": "How do I reverse a list in Python?"}]
SHORT_ANSWERS = ["What is 17 times 23?", "What is the boiling point of water in Fahrenheit?",
                 "Translate 'good morning' into French and Spanish."]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)


def stream_generate(base_url: str, text: str, **sampling) -> list[dict]:
    """The chunks of a streamed /generate (server-sent events up to [DONE])."""
    body = {"text": text, "sampling_params": sampling, "stream": True}
    chunks = []
    with requests.post(f"{base_url}/generate", json=body, stream=True, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                break
            chunks.append(json.loads(line[6:]))
    return chunks


def overran(meta: dict) -> bool:
    """The request finished inside a verified block: the server committed more tokens than it returned (the
    prefill token, plus every verify step's accepted drafts and bonus token)."""
    committed = 1 + meta.get("spec_verify_ct", 0) + meta.get("spec_num_correct_drafts", 0)
    return meta["completion_tokens"] < committed


def finish(reply: dict) -> dict:
    return reply["meta_info"]["finish_reason"]


# --- /generate streaming ----------------------------------------------------------------------------------------

def test_streamed_generate_equals_non_streamed_and_plain(chain_server, plain_server):
    sampling = {**GREEDY, "max_new_tokens": 48, "ignore_eos": True}
    whole = generate(chain_server.base_url, CODE_PROMPT, **sampling)
    chunks = stream_generate(chain_server.base_url, CODE_PROMPT, **sampling)
    texts = [c["text"] for c in chunks if c.get("text") is not None]
    if all(b.startswith(a) for a, b in zip(texts, texts[1:])):  # cumulative chunks (SGLang's default)
        texts = [b[len(a):] for a, b in zip([""] + texts, texts)]
    assert len(chunks) > 2
    assert "".join(texts) == whole["text"] == generate(plain_server.base_url, CODE_PROMPT, **sampling)["text"]
    assert chunks[-1]["output_ids"][-len(whole["output_ids"]):] == whole["output_ids"]


# --- OpenAI-compatible API --------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [CODE_PROMPT, STORY_PROMPT], ids=["code", "story"])
def test_v1_completions_equal_plain(chain_server, plain_server, prompt):
    def complete(server):
        return client(server).completions.create(model="default", prompt=prompt, max_tokens=32, temperature=0)

    got, want = complete(chain_server), complete(plain_server)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_v1_chat_completions_equal_plain_streamed_or_not(chain_server, plain_server):
    def chat(server, **kw):
        return client(server).chat.completions.create(model="default", messages=CHAT, max_tokens=40, temperature=0,
                                                      **kw)

    want = chat(plain_server).choices[0]
    got = chat(chain_server).choices[0]
    assert (got.message.content, got.finish_reason) == (want.message.content, want.finish_reason)
    deltas = [c.choices[0].delta.content or "" for c in chat(chain_server, stream=True) if c.choices]
    assert "".join(deltas) == want.message.content


# --- the frontend language --------------------------------------------------------------------------------------

def test_frontend_program_equals_plain(chain_server, plain_server):
    import sglang as sgl

    @sgl.function
    def explain(s, question):
        s += f"Q: {question}\nA:"
        s += sgl.gen("answer", max_tokens=32, temperature=0, stop=".")
        s += ".\nQ: Why is that useful?\nA:"
        s += sgl.gen("why", max_tokens=16, temperature=0)

    def run(server):
        return explain.run(question="What is a hash table?", backend=sgl.RuntimeEndpoint(server.base_url))

    got, want = run(chain_server), run(plain_server)
    assert got["answer"].strip() and got["why"].strip()
    assert (got["answer"], got["why"]) == (want["answer"], want["why"])
    assert got.text() == want.text()


# --- how a request finishes -------------------------------------------------------------------------------------

STOP_AT = (8, 13, 18, 23, 28, 33)  # token positions of the plain output where each stop string starts


def test_stop_strings_equal_plain(chain_server, plain_server, tokenizer):
    """Stop strings cut from the plain output at several places; at least one falls inside a verified block
    (the server cuts an accepted run)."""
    sampling = {**GREEDY, "max_new_tokens": 48}
    ids = generate(plain_server.base_url, STORY_PROMPT, **sampling, ignore_eos=True)["output_ids"]
    stops = [s for s in (tokenizer.decode(ids[k:k + 2]) for k in STOP_AT) if s.strip()]
    assert len(stops) >= 4, stops

    def ask(server):
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(lambda stop: generate(server.base_url, STORY_PROMPT, **sampling, stop=[stop]), stops))

    got, want = ask(chain_server), ask(plain_server)
    for stop, g, w in zip(stops, got, want):
        assert (g["text"], g["output_ids"], finish(g)) == (w["text"], w["output_ids"], finish(w)), stop
        assert finish(g)["type"] == "stop", (stop, finish(g))
    assert any(overran(g["meta_info"]) for g in got), [g["meta_info"] for g in got]


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_tiny_max_tokens_equal_plain(chain_server, plain_server, max_tokens):
    prompts = [CODE_PROMPT, STORY_PROMPT, "1, 2, 3, 4, 5, 6, 7, 8,", "import json\n\ndef load_config(path):\n"]
    sampling = {**GREEDY, "max_new_tokens": max_tokens, "ignore_eos": True}
    got = generate_all(chain_server.base_url, prompts, 4, **sampling)
    want = generate_all(plain_server.base_url, prompts, 4, **sampling)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert all(len(g["output_ids"]) == max_tokens and finish(g)["type"] == "length" for g in got)
    if max_tokens == 2:  # the first verify step accepted a draft: its block is cut at the cap
        assert any(overran(g["meta_info"]) for g in got), [g["meta_info"] for g in got]


def test_eos_finish_equals_plain(chain_server, plain_server, tokenizer):
    texts = [tokenizer.apply_chat_template([CHAT[0], {"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in SHORT_ANSWERS]
    sampling = {**GREEDY, "max_new_tokens": 96}
    want = generate_all(plain_server.base_url, texts, 4, **sampling)
    assert any(finish(w)["type"] == "stop" for w in want), [finish(w) for w in want]  # some answers end on EOS
    got = generate_all(chain_server.base_url, texts, 4, **sampling)
    for g, w in zip(got, want):
        assert (g["output_ids"], g["text"], finish(g)) == (w["output_ids"], w["text"], finish(w))


SPEC_FIELDS = ("spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts",
               "spec_num_proposed_drafts")


def spec_details(server, path: str, body: dict) -> tuple[dict, int]:
    """The reply's speculative details and its completion token count."""
    reply = requests.post(f"{server.base_url}/v1/{path}", timeout=600,
                          json={**body, "model": "default", "temperature": 0, "return_spec_tokens_details": True})
    reply.raise_for_status()
    return reply.json()["sglext"]["spec_tokens_details"], reply.json()["usage"]["completion_tokens"]


def test_openai_spec_tokens_details_are_dsparks_per_request_figures(chain_server):
    """`return_spec_tokens_details` (SGLang's per-request speculative fields, read by tools such as AIPerf) answers
    with DSPARK's figures, defined as /generate's meta_info defines them: tokens per verify step with the bonus
    (completion tokens / verify steps), accepted over verified drafts (not SGLang's fixed-length count), and an
    acceptance histogram over the request's verify steps whose weighted sum is its correct-draft count. How many
    drafts each step verifies follows the measured step cost, so two runs of one request may verify different
    counts: the figures are checked against the request's own tokens, not against another run's."""
    meta = generate(chain_server.base_url, CODE_PROMPT, max_new_tokens=48, **GREEDY)["meta_info"]
    replies = [spec_details(chain_server, "completions", {"prompt": CODE_PROMPT, "max_tokens": 48}),
               spec_details(chain_server, "chat/completions", {"messages": CHAT, "max_tokens": 48})]
    assert set(SPEC_FIELDS) <= set(meta) and set(SPEC_FIELDS) <= set(replies[0][0])
    for details, completion_tokens in replies:
        histogram = details["spec_correct_drafts_histogram"]
        assert details["spec_verify_ct"] > 0 and sum(histogram) == details["spec_verify_ct"], details
        assert sum(k * n for k, n in enumerate(histogram)) == details["spec_num_correct_drafts"], details
        # every verify step commits its accepted drafts and one bonus token; the prefill commits the first token
        committed = 1 + details["spec_verify_ct"] + details["spec_num_correct_drafts"]
        assert completion_tokens <= committed <= completion_tokens + len(histogram), details
        assert details["spec_accept_length"] == pytest.approx(completion_tokens / details["spec_verify_ct"])
        assert details["spec_num_correct_drafts"] <= details["spec_num_proposed_drafts"], details
        assert details["spec_accept_rate"] == pytest.approx(
            details["spec_num_correct_drafts"] / details["spec_num_proposed_drafts"])
