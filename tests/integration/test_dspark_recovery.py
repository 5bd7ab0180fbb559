"""Killing the draft worker mid-run: no request lost (greedy or sampled), no greedy token wrong; the worker restarts
and drafts again, also for a request whose radix-cached prefix was written to the killed worker (proved by the
worker-owned drafted-node count on /metrics)."""

import concurrent.futures as cf
import dataclasses
import os
import signal
import time

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import dspark_spec, generate
from sgl_dspark.tools.launch import serving

pytestmark = pytest.mark.integration

WORKER_MODULE = "sgl_dspark.draft_worker.process"
PROMPTS = ["def fibonacci(n):\n", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time, in a small village by the sea,"]
SAMPLED_PROMPTS = ["Write a haiku about autumn:", "List three colours:", "My favourite food is"]
GREEDY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 64, "ignore_eos": True}
GENERATION = "sglang:dspark_draft_worker_generation"
DRAFTED = "sglang:dspark_draft_worker_drafted_nodes"


@pytest.fixture(scope="module")
def server(default_model_path, random_drafter_path, tmp_path_factory):
    """DSPARK with the random drafter in a worker process and /metrics (the worker-owned draft count is read
    there)."""
    spec = dataclasses.replace(dspark_spec(default_model_path, random_drafter_path, draft_process=True),
                               extra_args=("--enable-metrics",))
    with serving(spec, tmp_path_factory.mktemp("recovery")) as running:
        yield running


def draft_workers(server) -> list[psutil.Process]:
    group = os.getpgid(server.process.pid)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if WORKER_MODULE in " ".join(proc.info["cmdline"] or []) and os.getpgid(proc.pid) == group:
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def wait_for_worker(server, exclude: set[int], timeout_s: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [p for p in draft_workers(server) if p.pid not in exclude]
        if fresh:
            return fresh[0]
        time.sleep(0.5)
    raise AssertionError("no draft worker process came up")


def gauge(base_url: str, name: str) -> float | None:
    """The value of a DSpark gauge on /metrics (None while it has never been set)."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    return max(values) if values else None


def wait_for_generation(base_url: str, at_least: int, timeout_s: float = 180) -> None:
    """Decode short requests (the client installs a restarted worker on its next call) until /metrics shows it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generate(base_url, "Hello", temperature=0, max_new_tokens=4)
        generation = gauge(base_url, GENERATION)
        assert generation is not None, (f"no {GENERATION} on /metrics: scheduler_patch/runtime/worker.py does not "
                                        "call draft_worker_state")
        if generation >= at_least:
            return
        time.sleep(0.5)
    raise AssertionError(f"{GENERATION} stayed below {at_least} for {timeout_s:g} s")


def test_killed_draft_worker_loses_nothing_and_drafts_again(plain_server, server):
    reference = [generate(plain_server.base_url, p, **GREEDY)["output_ids"] for p in PROMPTS]
    first = wait_for_worker(server, set())
    jobs = [(p, GREEDY) for p in PROMPTS] + [(p, SAMPLED) for p in SAMPLED_PROMPTS]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(generate, server.base_url, p, **params) for p, params in jobs]
        time.sleep(3.0)  # let decoding start, then kill the drafter in the middle of it
        first.send_signal(signal.SIGKILL)
        outputs = [f.result(timeout=600) for f in futures]
    assert [o["output_ids"] for o in outputs[:len(PROMPTS)]] == reference
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outputs)
    assert all(len(o["output_ids"]) == SAMPLED["max_new_tokens"] for o in outputs[len(PROMPTS):])
    second = wait_for_worker(server, {first.pid})
    assert second.pid != first.pid
    wait_for_generation(server.base_url, 1)
    before = gauge(server.base_url, DRAFTED)
    # Its prompt is in the radix cache since before the kill: the new worker drafts from the tokens written since.
    again = generate(server.base_url, PROMPTS[1] + " jumps", **GREEDY)
    assert again["meta_info"]["cached_tokens"] > 0 and again["meta_info"].get("spec_verify_ct", 0) > 0
    assert gauge(server.base_url, DRAFTED) > before
    assert "restarting" in server.log_text()
