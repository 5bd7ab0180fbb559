"""DSPARK observability on the real server (random drafter, --enable-metrics, a short decode log interval):
per-request meta_info spec_* values, SGLang's spec gauges and DSpark's own series on /metrics, and the periodic
decode log lines (DSpark's and SGLang's, which must agree on the accept rate), and the step-cost table profiled
at start-up and saved (--speculative-dspark-cost-table-out)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sgl_dspark.cost import load_cost_table
from sgl_dspark.tools.launch import serving
from conftest import dspark_spec, generate

pytestmark = pytest.mark.integration

LOG_INTERVAL = 4  # decode steps per log line
MAX_NEW_TOKENS = 24
# The random drafter's drafts are accepted now and then: greedily on this prompt, and at high temperatures (a flat
# target); the accept-rate agreement below needs some accepted drafts to tell the right rate from SGLang's own.
REQUESTS = (("The capital of France is", {"temperature": 0.0}), ("def fibonacci(n):\n", {"temperature": 0.0}),
            ("The capital of France is", {"temperature": 5.0}), ("1, 2, 3, 4,", {"temperature": 30.0}))
SPEC_KEYS = ("spec_accept_length", "spec_verify_ct", "spec_mean_draft_length", "spec_mean_verify_length",
             "spec_accept_rate")


@pytest.fixture(scope="module")
def cost_table_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cost") / "cost.json"


@pytest.fixture(scope="module")
def server(default_model_path, random_drafter_path, tmp_path_factory, cost_table_out):
    spec = dataclasses.replace(dspark_spec(default_model_path, random_drafter_path),
                               extra_args=("--enable-metrics", "--decode-log-interval", str(LOG_INTERVAL),
                                           "--speculative-dspark-cost-table-out", str(cost_table_out)))
    with serving(spec, tmp_path_factory.mktemp("observability")) as running:
        yield running


@pytest.fixture(scope="module")
def metas(server) -> list[dict]:
    return [generate(server.base_url, text, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, **sampling)["meta_info"]
            for text, sampling in REQUESTS]


def test_meta_info_carries_consistent_dspark_spec_values(metas):
    for meta in metas:
        assert all(key in meta for key in SPEC_KEYS), meta
        steps = meta["spec_verify_ct"]
        assert steps > 0 and meta["completion_tokens"] == MAX_NEW_TOKENS
        assert steps * meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"])
        assert 0.0 <= meta["spec_accept_rate"] <= 1.0
        assert 0.0 <= meta["spec_mean_verify_length"] <= meta["spec_mean_draft_length"]
        verified = meta["spec_num_proposed_drafts"]
        assert verified == pytest.approx(steps * meta["spec_mean_verify_length"])
        assert meta["spec_num_correct_drafts"] == pytest.approx(meta["spec_accept_rate"] * verified)
        # Every committed token is an accepted draft or a bonus token, after the prefill's first token.
        assert meta["spec_num_correct_drafts"] + steps + 1 >= meta["completion_tokens"]


def metric_samples(base_url: str) -> dict[str, list]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_show_sglangs_spec_gauges_and_dsparks_series(server, metas):
    families = metric_samples(server.base_url)
    rates = [s.value for s in families["sglang:spec_accept_rate"]]
    lengths = [s.value for s in families["sglang:spec_accept_length"]]
    assert rates and all(0.0 <= r <= 1.0 for r in rates)
    assert lengths and all(v >= 1.0 for v in lengths)
    steps = sum(meta["spec_verify_ct"] for meta in metas)
    counts = {s.name: s.value for s in families["sglang:dspark_verify_length"] if s.name.endswith("_count")}
    assert counts["sglang:dspark_verify_length_count"] >= steps
    accepted = {s.name: s.value for s in families["sglang:dspark_accept_length"]}
    assert accepted["sglang:dspark_accept_length_sum"] >= accepted["sglang:dspark_accept_length_count"] >= steps
    assert "sglang:dspark_draft_worker_failures" in families


OURS = re.compile(r"DSpark decode: steps=(\d+) accept_len=([\d.]+) draft_len=([\d.]+) verify_len=([\d.]+) "
                  r"accept_rate=([\d.]+) draft_ms=[\d.]+ verify_ms=[\d.]+ commit_ms=[\d.]+ drafted_ahead=[\d.]+ "
                  r"draft_failures=0")
SGLANGS = re.compile(r"Decode batch.*accept len: ([\d.]+), accept rate: ([\d.]+), cap len: ([\d.]+)")


def test_the_decode_log_lines_appear_at_the_interval_and_agree(server, metas):
    log = server.log_text()
    ours = [m.groups() for m in OURS.finditer(log)]
    sglangs = [m.groups() for m in SGLANGS.finditer(log)]
    assert ours and all(steps == str(LOG_INTERVAL) for steps, *_ in ours)
    assert any(float(rate) > 0 for *_, rate in ours), "no draft accepted: the agreement below would prove nothing"
    # Both count the same decode steps: same accept length and rate; SGLang's cap len is the verify window.
    assert [(length, rate) for _, length, _, _, rate in ours] == [(length, rate) for length, rate, _ in sglangs]
    for (_, _, _, verify_len, _), (_, _, cap_len) in zip(ours, sglangs):
        assert float(cap_len) == pytest.approx(float(verify_len) + 1, abs=0.011)


PROFILED = re.compile(r"step-cost table profiled in ([\d.]+) s .*: tokens=\[([\d, ]+)\] ms=")


def test_the_step_cost_table_is_profiled_at_start_up_and_saved(server, metas, cost_table_out):
    seconds, tokens = PROFILED.search(server.log_text()).groups()
    assert float(seconds) < 30.0 and tokens.startswith("1, 2, 4, 8")
    table = load_cost_table(cost_table_out)  # rewritten, refitted, every LOG_INTERVAL decode steps
    assert table.tokens == tuple(int(t) for t in tokens.split(", "))
    assert json.loads(cost_table_out.read_text())["meta"]["refit_steps"] >= LOG_INTERVAL
