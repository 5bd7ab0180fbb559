"""Data parallelism (issue 31): DSPARK under `--dp-size 2`.

Each replica has its own DSPARK worker, draft worker, lookup registry and suffix cache; nothing is shared, so nothing
has to agree. What is checked: greedy output identical to the plain server's on both replicas; a replica's suffix
cache is its own (a prompt sent again to the replica that answered it is accepted in longer runs than on the replica
that never saw it), shown per replica on /metrics (`dp_rank` label). The router: test_router.py.

The two replicas each take one of CI's two cores.
"""

import pytest
import requests

from conftest import GREEDY_128, dspark_spec, generate_all, warm_prefix_cache
from sgl_dspark.tools.launch import serving
from sgl_dspark.tools.models import SHIPPED_DRAFTER
from test_dspark_lossless import mismatches
from test_dspark_observability import metric_samples

pytestmark = pytest.mark.integration

SUBSET = [0, 7, 12, 19]  # two chat prompts (shared system prompt), two raw/code ones
REPEATED = 3  # a chat prompt of the `prompts` fixture (not in SUBSET), sent to replica 0 twice, then to replica 1
METRICS = ("--enable-metrics",)


def series(base_url: str, sample: str) -> dict[str, float]:
    """One sample of DSPARK's series on /metrics, per replica: {dp_rank ("" without DP): value}."""
    return {s.labels.get("dp_rank", ""): s.value for samples in metric_samples(base_url).values() for s in samples
            if s.name == sample}


def pinned(base_url: str, text: str, dp_rank: int) -> dict:
    """A greedy request sent to one replica (SGLang's `routed_dp_rank`)."""
    body = {"text": text, "sampling_params": GREEDY_128, "routed_dp_rank": dp_rank}
    reply = requests.post(f"{base_url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()


@pytest.fixture(scope="module")
def dp_server(default_model_path, plain_reference, tmp_path_factory):
    """DSPARK with the shipped drafter and its recommended knobs (lookup and the suffix cache), two data-parallel
    replicas, /metrics. The gate is off and every drafted node is verified (`--speculative-dspark-budget off`): every
    request drafts every step and the verify width does not follow the machine's measured step costs, so acceptance
    shows the suffix cache's state, not the gate's (which holds a replica's requests back after poor acceptance; its
    own tests: test_dspark_gate.py) nor a width priced by timings taken under load (CI runs the unit tests beside)."""
    spec = dspark_spec(default_model_path, str(SHIPPED_DRAFTER), "--dp-size", "2", "--speculative-dspark-budget",
                       "off", *METRICS)
    with serving(spec, tmp_path_factory.mktemp("dspark-dp2")) as server:
        yield server


def test_dspark_dp2_is_greedy_identical_to_plain(dp_server, prompts, plain_reference):
    warm_prefix_cache(dp_server.base_url, prompts)
    replies = generate_all(dp_server.base_url, [prompts[i] for i in SUBSET], 2, **GREEDY_128)
    assert not mismatches(replies, [plain_reference[i] for i in SUBSET], SUBSET)
    assert sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in replies) > 0  # drafts accepted
    steps = series(dp_server.base_url, "sglang:dspark_accept_length_count")
    assert set(steps) >= {"0", "1"}, steps  # both replicas decoded, each with its own series


def hits(base_url: str) -> dict[str, float]:
    return series(base_url, "sglang:dspark_lookup_accepted_tokens_total")


def test_each_replica_owns_its_suffix_cache(dp_server, prompts, plain_reference):
    replies, gained = [], []
    for rank in (0, 0, 1):  # first visit, the same prompt again, then the replica that never saw it
        before = hits(dp_server.base_url)
        replies.append(pinned(dp_server.base_url, prompts[REPEATED], rank))
        after = hits(dp_server.base_url)
        gained.append({k: v - before.get(k, 0.0) for k, v in after.items()})
    assert all(r["output_ids"] == plain_reference[REPEATED] for r in replies)
    # Only the pinned replica's lookup moved; the second visit to replica 0 finds the first answer in its suffix
    # cache, replica 1 starts from nothing as replica 0 did.
    assert gained[0].get("1", 0) == gained[1].get("1", 0) == gained[2].get("0", 0) == 0, gained
    assert gained[1]["0"] > 3 * max(gained[2]["1"], 1) and gained[1]["0"] > 3 * max(gained[0]["0"], 1), gained
    accept = [r["meta_info"]["spec_accept_length"] for r in replies]
    assert accept[1] > 1.5 * max(accept[0], accept[2]), accept
    cached = series(dp_server.base_url, "sglang:dspark_suffix_cache_tokens")
    assert cached.get("0", 0) > 0 and cached.get("1", 0) > 0, cached
