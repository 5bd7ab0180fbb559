"""SGLang's offline engine runs DSPARK: `sglang.Engine(..., speculative_algorithm="DSPARK",
speculative_draft_model_path=D, speculative_dspark_<knob>=V)` answers greedy requests as the plain server does,
with the spec figures in meta_info; a bad knob stops it with one line naming the knob. Each engine runs in its own
Python process (it spawns SGLang's scheduler processes and is shut down there)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import generate
from sgl_dspark.tools.launch import CPU_ENV, has_cuda

pytestmark = pytest.mark.integration

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
SCRIPT = """
import json, sys
import sglang

cpu = {"device": "cpu", "sleep_on_idle": True} if sys.argv[3] == "cpu" else {}
engine = sglang.Engine(model_path=sys.argv[1], speculative_algorithm="DSPARK", speculative_draft_model_path=sys.argv[2],
                       dtype="float32", max_total_tokens=8192, max_running_requests=4, **cpu, **json.loads(sys.argv[4]))
try:
    out = engine.generate(sys.argv[5], json.loads(sys.argv[6]))
    print("RESULT " + json.dumps(out))
finally:
    engine.shutdown()
"""


def run_engine(model: str, drafter: str, knobs: dict, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **({} if has_cuda() else CPU_ENV)}
    argv = [sys.executable, "-c", SCRIPT, model, drafter, "gpu" if has_cuda() else "cpu", json.dumps(knobs), PROMPT,
            json.dumps(GREEDY)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)


def test_engine_serves_dspark_with_keyword_knobs(default_model_path, bigram_drafter_path, plain_server):
    done = run_engine(default_model_path, bigram_drafter_path, {"speculative_dspark_lookup": True,
                                                                 "speculative_dspark_preset": "tree",
                                                                 "speculative_dspark_gate": False})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    plain = generate(plain_server.base_url, PROMPT, **GREEDY)
    assert out["output_ids"] == plain["output_ids"]
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.0, meta


def test_engine_refuses_a_bad_knob_with_one_line(default_model_path, random_drafter_path):
    done = run_engine(default_model_path, random_drafter_path, {"speculative_dspark_max_window": 0}, timeout_s=300)
    assert done.returncode != 0
    assert "DSpark config: max_window=0 is invalid" in done.stderr, done.stderr[-3000:]
