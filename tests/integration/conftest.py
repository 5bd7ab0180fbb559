"""Integration fixtures: real SGLang servers on this machine, started once per session and always stopped."""

import json
from pathlib import Path

import pytest
import requests

from sgl_dspark.server import ServerSpec, free_port, serving

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.json"


@pytest.fixture(scope="session")
def plain_server(default_model_path, tmp_path_factory):
    """The default model, float32, no speculation."""
    spec = ServerSpec(default_model_path, port=free_port())
    with serving(spec, tmp_path_factory.mktemp("plain")) as server:
        yield server


@pytest.fixture(scope="session")
def random_drafter_path(default_model_path, tmp_path_factory) -> str:
    """A seeded random DSpark drafter shaped for the default model (enough to test losslessness); one layer and a
    4096-token draft vocabulary keep CPU drafting cheap (and exercise the reduced-vocabulary path)."""
    from sgl_dspark.drafter.factory import save_random_drafter_for

    return save_random_drafter_for(default_model_path, str(tmp_path_factory.mktemp("drafter")), seed=0,
                                   num_layers=1, draft_vocab_size=4096)


def dspark_spec(model_path: str, drafter_path: str, *flags: str, max_running_requests: int = 4) -> ServerSpec:
    return ServerSpec(model_path, port=free_port(), max_running_requests=max_running_requests,
                      speculative_args=("--speculative-algorithm", "DSPARK",
                                        "--speculative-draft-model-path", drafter_path, *flags))


@pytest.fixture(scope="session")
def dspark_server(default_model_path, random_drafter_path, tmp_path_factory):
    """DSPARK with the random drafter, chain drafting, default preset."""
    with serving(dspark_spec(default_model_path, random_drafter_path), tmp_path_factory.mktemp("dspark")) as server:
        yield server


@pytest.fixture(scope="session")
def prompts(default_model_path) -> list[str]:
    """20 prompts: 10 chat prompts sharing one long system prompt (radix-cache hits) and 10 raw/code prompts."""
    from transformers import AutoTokenizer

    doc = json.loads(PROMPTS_FILE.read_text())
    tok = AutoTokenizer.from_pretrained(default_model_path)
    chats = [tok.apply_chat_template([{"role": "system", "content": doc["system"]}, {"role": "user", "content": q}],
                                     tokenize=False, add_generation_prompt=True) for q in doc["chat_questions"]]
    return chats + doc["raw_prompts"]


def generate(base_url: str, text: str, **sampling) -> dict:
    reply = requests.post(f"{base_url}/generate", json={"text": text, "sampling_params": sampling}, timeout=600)
    reply.raise_for_status()
    return reply.json()
