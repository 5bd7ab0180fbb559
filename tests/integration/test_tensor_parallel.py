"""Tensor parallelism on the CPU (issue 31): `--tp-size 2` serves the default model with greedy output identical to
`--tp-size 1`, plain and DSPARK, and DSPARK plans each step once (on TP rank 0, broadcast to rank 1:
scheduler_patch/runtime/tensor_parallel.py).

Plain SGLang 0.5.23 cannot start TP on a CPU by itself; the plugin's named patches (scheduler_patch/cpu_parallel.py)
turn PyNccl off for CPU groups (the all-reduce runs on gloo) and bind each rank to its share of the cores. The two
ranks use both of CI's cores, so the module's servers run one at a time: the plain TP server answers first and
stops, then the DSPARK one starts. The reference is the session's plain `--tp-size 1` server (`plain_reference`).
Two nodes: test_multi_node.py.
"""

import re

import pytest
import requests

from conftest import GREEDY_128, dspark_spec, generate, generate_all, warm_prefix_cache
from sgl_dspark.tools.launch import ServerSpec, free_port, serving
from sgl_dspark.tools.models import SHIPPED_DRAFTER
from test_dspark_lossless import mismatches

pytestmark = pytest.mark.integration

TP = ("--tp-size", "2")
SUBSET = [0, 3, 7, 12, 16, 19]  # chat prompts (shared system prompt) and raw/code ones of the `prompts` fixture
SEEDED = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32, "sampling_seed": 7}


def greedy(server, prompts: list[str], subset: list[int] = SUBSET) -> list[dict]:
    warm_prefix_cache(server.base_url, prompts)
    return generate_all(server.base_url, [prompts[i] for i in subset], 3, **GREEDY_128)


@pytest.fixture(scope="module")
def plain_tp_replies(default_model_path, prompts, plain_reference, tmp_path_factory) -> list[dict]:
    """The plain TP=2 server's greedy replies (the reference is computed first, so only one TP server runs)."""
    spec = ServerSpec(default_model_path, port=free_port(), extra_args=TP)
    with serving(spec, tmp_path_factory.mktemp("plain-tp2")) as server:
        return greedy(server, prompts)


@pytest.fixture(scope="module")
def dspark_tp_server(default_model_path, plain_tp_replies, tmp_path_factory):
    """DSPARK as a user starts it (the shipped drafter and its recommended knobs: lookup and the suffix cache; the
    gate on), on two TP ranks."""
    spec = dspark_spec(default_model_path, str(SHIPPED_DRAFTER), *TP, gate=True)
    with serving(spec, tmp_path_factory.mktemp("dspark-tp2")) as server:
        yield server


def test_plain_tp2_is_greedy_identical_to_tp1(plain_tp_replies, plain_reference):
    assert not mismatches(plain_tp_replies, [plain_reference[i] for i in SUBSET], SUBSET)


def test_dspark_tp2_is_greedy_identical_to_plain_and_accepts_drafts(dspark_tp_server, prompts, plain_reference):
    replies = greedy(dspark_tp_server, prompts)
    assert not mismatches(replies, [plain_reference[i] for i in SUBSET], SUBSET)
    metas = [r["meta_info"] for r in replies]
    assert sum(m.get("spec_num_correct_drafts", 0) for m in metas) > 0, metas  # drafts were verified and accepted
    assert all(m["completion_tokens"] == GREEDY_128["max_new_tokens"] for m in metas)
    shares = [float(ms) for ms in re.findall(r"DSpark decode: .* share_ms=([\d.]+)", dspark_tp_server.log_text())]
    assert shares and max(shares) > 0, shares  # the plan's broadcast is timed in the step split


def test_dspark_tp2_serves_seeded_sampling_logprobs_and_stops(dspark_tp_server, prompts):
    """A seeded sampled request gives one output however often it is sent (every rank draws the same coins, or
    the ranks' KV would part and the server hang); logprobs and stop strings are served."""
    first, second = (generate(dspark_tp_server.base_url, prompts[3], **SEEDED) for _ in range(2))
    assert first["output_ids"] == second["output_ids"] and len(first["output_ids"]) > 1
    body = {"text": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 24}, "return_logprob": True}
    reply = requests.post(f"{dspark_tp_server.base_url}/generate", json=body, timeout=600).json()
    logprobs = reply["meta_info"]["output_token_logprobs"]
    assert len(logprobs) == len(reply["output_ids"]) and all(lp[0] <= 0 for lp in logprobs)
    text = generate(dspark_tp_server.base_url, prompts[16], **GREEDY_128)["text"]
    stop = text.split()[3]
    cut = generate(dspark_tp_server.base_url, prompts[16], temperature=0, max_new_tokens=128, stop=[stop])
    assert cut["meta_info"]["finish_reason"]["type"] == "stop" and stop not in cut["text"]

