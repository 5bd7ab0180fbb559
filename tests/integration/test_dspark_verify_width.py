"""One verify width: with the scheduler off and lookup on, every drafted node and every lookup node is verified, so
a step writes the most rows it ever can; SGLang's per-request KV reserve (speculative_num_draft_tokens) counts the
lookup nodes too (sgl_dspark.config.verify_nodes), and greedy output on copy-heavy prompts equals plain decoding."""

import re

import pytest

from conftest import dspark_spec, generate_all
from sgl_dspark.config import load_config
from sgl_dspark.tools.launch import serving

pytestmark = pytest.mark.integration

COPY_HEAVY = [
    "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "Alice said hello to Bob. Bob said hello to Alice. Alice said hello to Bob. Bob said",
]
GREEDY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}


def test_lookup_rows_fit_the_reserved_width_and_output_is_plain(default_model_path, bigram_drafter_path,
                                                                plain_server, tmp_path_factory):
    flags = ("--speculative-dspark-preset", "no-budget", "--speculative-dspark-lookup", "true")
    want = 1 + load_config("no-budget", {"lookup": True}).verify_nodes(7)
    reference = [r["output_ids"] for r in generate_all(plain_server.base_url, COPY_HEAVY, 2, **GREEDY)]
    with serving(dspark_spec(default_model_path, bigram_drafter_path, *flags),
                 tmp_path_factory.mktemp("dspark-width")) as server:
        replies = generate_all(server.base_url, COPY_HEAVY, 2, **GREEDY)
        log = server.log_text()
    assert [r["output_ids"] for r in replies] == reference
    declared = int(re.search(r"DSPARK on \w+, (\d+) verify tokens per request", log).group(1))
    assert declared == want  # the drafter's 7 nodes plus the lookup's 16, anchor included
    widest = max(r["meta_info"]["spec_mean_verify_length"] for r in replies)
    assert widest > 7, widest  # lookup nodes were verified beside the drafter's chain
    assert "exceeds the reserved verify width" not in log
