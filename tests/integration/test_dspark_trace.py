"""The step trace (`--speculative-dspark-trace`) on the real server: one record per request per verify step, keyed
by the rid the client sent, consistent with the request's meta_info (benchmarks/acceptance.py relies on both)."""

import pytest

from sgl_dspark.tools.launch import serving
from sgl_dspark.trace import read_trace
from conftest import dspark_spec

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 24
REQUESTS = (("trace-greedy", "def fibonacci(n):\n", 0.0), ("trace-sampled", "1, 2, 3, 4,", 1.0))


@pytest.fixture(scope="module")
def traced(default_model_path, random_drafter_path, tmp_path_factory):
    """(trace records, {rid: meta_info}) of two short requests on a DSPARK server with lookup and the trace on."""
    log_dir = tmp_path_factory.mktemp("trace")
    path = log_dir / "trace.jsonl"
    spec = dspark_spec(default_model_path, random_drafter_path, "--speculative-dspark-lookup", "true",
                       "--speculative-dspark-trace", str(path))
    with serving(spec, log_dir) as server:
        metas = {rid: generate_with_rid(server.base_url, rid, text, temperature) for rid, text, temperature in REQUESTS}
    return read_trace(path), metas


def generate_with_rid(base_url: str, rid: str, text: str, temperature: float) -> dict:
    import requests

    reply = requests.post(f"{base_url}/generate", timeout=600, json={
        "rid": rid, "text": text,
        "sampling_params": {"temperature": temperature, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}})
    reply.raise_for_status()
    return reply.json()["meta_info"]


def test_one_record_per_verify_step_of_each_request(traced):
    records, metas = traced
    for rid, meta in metas.items():
        mine = [r for r in records if r.rid == rid]
        assert len(mine) == meta["spec_verify_ct"]
        # every step commits tau tokens; the prefill's token comes on top, the last step may overshoot the limit
        assert sum(r.tau for r in mine) >= meta["completion_tokens"] - 1


def test_records_are_self_consistent(traced):
    records, _ = traced
    for r in records:
        assert 0 <= r.chain_accepted <= len(r.chain_conf) <= r.verified <= r.drafted
        assert r.tau - 1 <= r.reached <= r.verified
        assert 0 <= r.lookup_accepted <= r.tau - 1
        assert all(0.0 <= c <= 1.0 for c in r.chain_conf)
