"""Two DSPARK servers behind `sglang-router` (issue 31 item 3; the router is the PyPI package, `make install` puts it
in the venv): greedy output identical to the plain server's, and the router's cache-aware policy keeping a
conversation's turns on one server, whose lookup then gets hits (a turn that repeats the previous answer is drafted
from the request's own context and that server's suffix cache), read per server on /metrics.

The two servers each take one of CI's two cores; the module runs alone (test_data_parallel.py's replicas have
stopped).
"""

import pytest

from conftest import dspark_spec, generate
from sgl_dspark.tools.launch import routing, serving_together
from sgl_dspark.tools.models import SHIPPED_DRAFTER
from test_data_parallel import series

pytestmark = pytest.mark.integration

GREEDY_64 = {"temperature": 0, "max_new_tokens": 64}
CONVERSATIONS = [["Write a Python function that tells whether a number is prime.",
                  "Repeat the function exactly as you wrote it.", "Once more, the same function, unchanged."],
                 ["Write a short poem about the sea.", "Repeat the poem exactly.",
                  "Once more, the same poem, unchanged."]]


@pytest.fixture(scope="module")
def routed(default_model_path, plain_server, tmp_path_factory):
    """Two DSPARK servers as a user starts them (shipped drafter, recommended knobs, the gate on), /metrics, behind
    the router."""
    log_dir = tmp_path_factory.mktemp("dspark-routed")
    specs = [dspark_spec(default_model_path, str(SHIPPED_DRAFTER), "--enable-metrics", gate=True) for _ in range(2)]
    with serving_together([(specs[0], log_dir / "a"), (specs[1], log_dir / "b")]) as (a, b):
        with routing([a.base_url, b.base_url], log_dir / "router.log") as url:
            yield url, (a, b)


def counts(servers) -> list[tuple[float, float]]:
    """Per server: (request decode steps, lookup hits) so far."""
    return [(sum(series(s.base_url, "sglang:dspark_accept_length_count").values()),
             sum(series(s.base_url, "sglang:dspark_lookup_accepted_tokens_total").values())) for s in servers]


@pytest.mark.parametrize("turns", CONVERSATIONS, ids=["code", "poem"])
def test_a_conversation_stays_on_one_server_and_its_lookup_hits(routed, plain_server, tokenizer, turns):
    url, servers = routed
    messages, served, repeat_hits = [], set(), []
    for question in turns:
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before = counts(servers)
        reply = generate(url, text, **GREEDY_64)
        after = counts(servers)
        assert reply["output_ids"] == generate(plain_server.base_url, text, **GREEDY_64)["output_ids"]
        moved = [i for i, (b, a) in enumerate(zip(before, after)) if a[0] > b[0]]
        assert len(moved) == 1, (before, after)  # one server decoded the turn
        served.add(moved[0])
        repeat_hits.append(after[moved[0]][1] - before[moved[0]][1])
        messages.append({"role": "assistant", "content": reply["text"]})
    assert len(served) == 1, served  # cache-aware routing: the turns share a prefix, so they share a server
    assert min(repeat_hits[1:]) > 10, repeat_hits  # the repeated answer is drafted from the lookup
