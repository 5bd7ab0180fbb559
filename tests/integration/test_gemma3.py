"""A second architecture: Gemma-3-270M (sliding-window layers, a 262k vocabulary, Gemma norms, GeGLU), prepared from
its PyPI packages (Gemma terms of use) and served by the real SGLang server on CPU in float32.

DSPARK with the shipped Gemma drafter is greedy token-identical to the plain server on a handful of prompts x 64
tokens, two of them longer than the 512-token sliding window (so verification has to drop keys older than the
window on 15 of the 18 layers, as plain decoding does), and it accepts drafts. One plain and one DSPARK server,
the second started while the first answers.
"""

import json
import sysconfig
from pathlib import Path

import pytest

from conftest import PROMPTS_FILE, dspark_spec, generate_all
from sgl_dspark.tools.launch import ServerSpec, free_port, relay

pytestmark = pytest.mark.integration

WINDOW = 512  # Gemma-3's sliding window (HF count, the query included)
GREEDY_64 = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
LONG_SOURCE_CHARS = 3000  # of a standard-library module: ~800 Gemma tokens


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from sgl_dspark.tools.models import GEMMA3, prepare

    return str(prepare("float32", source=GEMMA3).path)


@pytest.fixture(scope="module")
def gemma_prompts(gemma_path) -> list[str]:
    """Two chat prompts, two raw ones, and two longer than the window: a chat with a long system prompt plus a
    module's source, and raw Python source."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_path)

    def chat(question: str) -> str:  # the server's tokenizer adds the BOS the template starts with
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        return text.removeprefix(tok.bos_token)

    doc = json.loads(PROMPTS_FILE.read_text())
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:LONG_SOURCE_CHARS]
    long_chat = chat(f"{doc['system']}\n\n{source}\n\nExplain what this module does.")
    return [chat(q) for q in doc["chat_questions"][:2]] + doc["raw_prompts"][:2] + [long_chat, source]


def test_prepared_folder_is_gemma3_with_windows_bos_and_chat_template(gemma_path, gemma_prompts):
    from transformers import AutoTokenizer

    config = json.loads((Path(gemma_path) / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == 262144
    assert config["sliding_window"] == WINDOW and config["layer_types"].count("sliding_attention") == 15
    tok = AutoTokenizer.from_pretrained(gemma_path)
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<start_of_turn>model\n")
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in gemma_prompts]
    assert sum(n > WINDOW for n in lengths) == 2, lengths


@pytest.fixture(scope="module")
def gemma_servers(gemma_path, tmp_path_factory):
    """The plain server, then the DSPARK one with the shipped Gemma drafter, started while the plain one answers."""
    from sgl_dspark.tools.models import GEMMA3, default_drafter

    drafter = default_drafter(gemma_path)
    assert drafter == str(GEMMA3.drafter), "the shipped Gemma drafter is missing"
    jobs = {"plain": (ServerSpec(gemma_path, port=free_port()), tmp_path_factory.mktemp("gemma-plain")),
            "dspark": (dspark_spec(gemma_path, drafter), tmp_path_factory.mktemp("gemma-dspark"))}
    with relay(jobs) as servers:
        yield servers


@pytest.fixture(scope="module")
def plain_replies(gemma_servers, gemma_prompts) -> list[dict]:
    with gemma_servers.serving("plain") as server:
        return generate_all(server.base_url, gemma_prompts, 4, **GREEDY_64)


@pytest.fixture(scope="module")
def dspark_replies(gemma_servers, gemma_prompts, plain_replies) -> list[dict]:
    with gemma_servers.serving("dspark") as server:
        return generate_all(server.base_url, gemma_prompts, 4, **GREEDY_64)


def test_dspark_is_greedy_identical_to_plain_across_the_window(plain_replies, dspark_replies):
    for i, (plain, dspark) in enumerate(zip(plain_replies, dspark_replies)):
        assert dspark["output_ids"] == plain["output_ids"], f"prompt {i} differs"
        assert len(plain["output_ids"]) == GREEDY_64["max_new_tokens"]
    assert max(r["meta_info"]["prompt_tokens"] for r in plain_replies) > WINDOW + 64


def test_dspark_accepts_drafts_on_gemma(dspark_replies):
    accept = [r["meta_info"]["spec_accept_length"] for r in dspark_replies]
    print(f"Gemma-3-270M DSPARK accepted length per prompt: {[round(a, 2) for a in accept]}")
    assert sum(accept) / len(accept) > 1.0
