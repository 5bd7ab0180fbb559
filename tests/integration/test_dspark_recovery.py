"""Killing the draft worker mid-run: no request lost, no token wrong, the worker restarts and drafts again."""

import concurrent.futures as cf
import os
import signal
import time

import psutil

from conftest import generate

WORKER_MODULE = "sgl_dspark.draft_worker.process"
PROMPTS = ["def fibonacci(n):\n", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time, in a small village by the sea,"]
GREEDY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}


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


def test_killed_draft_worker_loses_nothing_and_restarts(plain_server, dspark_server):
    reference = [generate(plain_server.base_url, p, **GREEDY)["output_ids"] for p in PROMPTS]
    first = wait_for_worker(dspark_server, set())
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(generate, dspark_server.base_url, p, **GREEDY) for p in PROMPTS]
        time.sleep(3.0)  # let decoding start, then kill the drafter in the middle of it
        first.send_signal(signal.SIGKILL)
        outputs = [f.result(timeout=600) for f in futures]
    assert [o["output_ids"] for o in outputs] == reference
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outputs)
    second = wait_for_worker(dspark_server, {first.pid})
    assert second.pid != first.pid
    after = generate(dspark_server.base_url, "Write a short poem about the sea.", **GREEDY)
    assert after["meta_info"].get("spec_verify_ct", 0) > 0
    assert "restarting" in dspark_server.log_text()
