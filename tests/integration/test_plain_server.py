"""The real SGLang server on CPU, without speculation: the APIs answer and the plugin ran in every process."""

import re

import requests

from scheduler_patch.plugin import ANNOUNCE

GREEDY = {"temperature": 0, "max_new_tokens": 16}


def test_health_generate(plain_server):
    assert requests.get(f"{plain_server.base_url}/health_generate", timeout=60).status_code == 200


def test_generate_is_deterministic_under_greedy(plain_server):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    first = requests.post(f"{plain_server.base_url}/generate", json=body, timeout=120).json()
    second = requests.post(f"{plain_server.base_url}/generate", json=body, timeout=120).json()
    assert first["meta_info"]["completion_tokens"] == 16
    assert first["text"] == second["text"]
    assert "Paris" in first["text"]


def test_v1_completions(plain_server):
    body = {"model": "default", "prompt": "def add(a, b):\n", "max_tokens": 12, "temperature": 0}
    reply = requests.post(f"{plain_server.base_url}/v1/completions", json=body, timeout=120).json()
    assert reply["usage"]["completion_tokens"] == 12
    assert "return" in reply["choices"][0]["text"]


def test_plugin_loaded_in_main_scheduler_and_detokenizer(plain_server):
    lines = [line for line in plain_server.log_text().splitlines() if ANNOUNCE in line]
    roles = {m.group(1) for line in lines if (m := re.search(r"process=(\S+)", line))}
    pids = {m.group(1) for line in lines if (m := re.search(r"pid=(\d+)", line))}
    assert {"main", "scheduler", "detokenizer"} <= roles, roles
    assert len(pids) >= 3
