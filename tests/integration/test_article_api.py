"""The seed article's example, run as its reader would: `DSparkConfig` with the article's four fields over the default
model and its shipped drafter, `DSparkEngine(config).generate(prompt, ...)` at temperature 0, answers exactly as plain
SGLang does, with the article's figures measured. draft_length is the drafter's gamma (7; the article's 16 is refused
by a drafter that drafts 7, tests/unit/test_engine_api.py). One engine start, in its own Python process (it spawns
SGLang's processes); the engine sets the CPU environment itself."""

import json
import subprocess
import sys

import pytest

from conftest import generate
from sgl_dspark.drafter.checkpoint import read_drafter_config
from sgl_dspark.tools.models import SHIPPED_DRAFTER

pytestmark = pytest.mark.integration

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
SAMPLING = {"max_new_tokens": 48, "temperature": 0.0, "top_p": 0.9}
SCRIPT = """
import dataclasses, json, sys
from sgl_dspark import DSparkEngine, DSparkConfig

config = DSparkConfig(model_path=sys.argv[1], **json.loads(sys.argv[2]))
engine = DSparkEngine(config)
try:
    output = engine.generate(sys.argv[3], **json.loads(sys.argv[4]))
    print("RESULT " + json.dumps(dataclasses.asdict(output)))
finally:
    engine.shutdown()
"""


def article_fields() -> dict:
    return {"draft_length": read_drafter_config(SHIPPED_DRAFTER).gamma, "confidence_threshold": 0.7,
            "use_hierarchical_verify": True, "hardware_aware": True}


def test_the_articles_example_answers_as_plain_sglang(default_model_path, plain_server):
    argv = [sys.executable, "-c", SCRIPT, default_model_path, json.dumps(article_fields()), PROMPT,
            json.dumps(SAMPLING)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    plain = generate(plain_server.base_url, PROMPT, **SAMPLING)
    assert out["output_ids"] == plain["output_ids"] and out["text"] == plain["text"]
    assert out["tokens_per_second"] > 0 and out["avg_draft_length"] >= 0, out
    assert 0 <= out["acceptance_rate"] <= 1 and out["accept_length"] >= 1, out
