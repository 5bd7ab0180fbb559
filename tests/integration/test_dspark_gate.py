"""The speculation gate on the real server (`--speculative-dspark-gate true`): which requests draft each step is
decided from the measured step costs and what speculating gave each request before, so it varies with the machine's
timings, and greedy output must stay the plain server's whatever it decides.

- The shipped drafter with its recommended knobs and the gate: output token-identical to plain at concurrency 1 and
  4, and the decode log lines and /metrics show the gate's decisions.
- The random drafter (its drafts are essentially never accepted): the gate stops drafting for it, drafting again
  only for new requests and on probe steps, and output is still plain's."""

import dataclasses
import re

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import GREEDY_128, dspark_spec, generate_all, warm_prefix_cache
from sgl_dspark.gate import PROBE_EVERY
from sgl_dspark.tools.launch import serving

pytestmark = pytest.mark.integration

SUBSET = [0, 3, 7, 10, 14, 18]  # chat and raw/code prompts
GATE_LINE = re.compile(r"DSpark decode: steps=(\d+) accept_len=([\d.]+) .* speculated=([\d.]+) spec_steps=([\d.]+)")


def gated_spec(model_path: str, drafter: str):
    spec = dspark_spec(model_path, drafter, gate=True)
    return dataclasses.replace(spec, extra_args=("--enable-metrics", "--decode-log-interval", "10"))


def gate_lines(log: str) -> list[tuple[float, float]]:
    """(speculated share of request-steps, share of steps with any drafting) per `DSpark decode:` line."""
    return [(float(m.group(3)), float(m.group(4))) for m in GATE_LINE.finditer(log)]


def request_steps(base_url: str) -> dict[str, float]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "sglang:dspark_request_steps")
    return {s.labels["speculated"]: s.value for s in family.samples if s.name.endswith("_total")}


def check_identical(server, prompts, plain_reference, concurrency: int) -> list[dict]:
    warm_prefix_cache(server.base_url, prompts)
    replies = generate_all(server.base_url, [prompts[i] for i in SUBSET], concurrency, **GREEDY_128)
    for i, reply in zip(SUBSET, replies):
        assert reply["output_ids"] == plain_reference[i], f"prompt {i}: output differs from the plain server's"
    return replies


def test_the_gate_is_lossless_and_reports_its_decisions(default_model_path, prompts, plain_reference,
                                                         tmp_path_factory):
    from sgl_dspark.tools.models import SHIPPED_DRAFTER

    with serving(gated_spec(default_model_path, str(SHIPPED_DRAFTER)), tmp_path_factory.mktemp("gate")) as server:
        for concurrency in (1, 4):
            check_identical(server, prompts, plain_reference, concurrency)
        lines, counted = gate_lines(server.log_text()), request_steps(server.base_url)
    assert lines and all(0.0 <= spec <= 1.0 and 0.0 <= steps <= 1.0 for spec, steps in lines)
    assert counted["true"] > 0  # new requests draft in their first step at least
    assert counted["true"] + counted["false"] >= len(SUBSET) * 2 * 128 / 8  # every decode step counted


def test_the_gate_stops_a_drafter_that_never_pays(default_model_path, random_drafter_path, prompts, plain_reference,
                                                  tmp_path_factory):
    with serving(gated_spec(default_model_path, random_drafter_path), tmp_path_factory.mktemp("gate-rnd")) as server:
        check_identical(server, prompts, plain_reference, 4)
        lines, counted = gate_lines(server.log_text()), request_steps(server.base_url)
    share = counted["true"] / (counted["true"] + counted["false"])
    # First steps (one per request) and one probe step in PROBE_EVERY: about 1/16 + 1/128 of the request-steps.
    assert share < 2.0 / PROBE_EVERY + 0.05, (share, lines)
    assert min(spec for spec, _ in lines) < 0.2, lines
