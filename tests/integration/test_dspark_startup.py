"""A refused DSPARK launch of the real server stops during argument resolution with one clear line naming the
cause (no traceback), quickly, and leaves no process behind."""

import time

import psutil
import pytest

from sgl_dspark.drafter import save_drafter
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.tools.launch import ServerError, ServerSpec, free_port, start

pytestmark = pytest.mark.integration

REFUSAL_WITHIN_S = 90.0  # argument resolution runs before any model is loaded (~10 s here)
# The default model (SmolLM2-135M): hidden 576, 9 heads / 3 KV heads of 64, vocab 49,152, 30 layers.
FITS_TARGET = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
               "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 49152, "mask_token_id": 0,
               "markov_rank": 4, "target_layer_ids": [1, 15, 28], "num_target_layers": 30}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    shapes = {"fits": FITS_TARGET, "hidden": {}, "vocab": {**FITS_TARGET, "vocab_size": 32000}}
    return {name: str(save_drafter(random_drafter(tiny_hf_config(**shape))[0], root / name))
            for name, shape in shapes.items()}


def refusal(model_path: str, args: tuple[str, ...], log_dir) -> str:
    """Start a DSPARK server that must be refused; return its one-line reason after checking the aftermath."""
    port = free_port()
    spec = ServerSpec(model_path, port=port, startup_timeout_s=REFUSAL_WITHIN_S,
                      speculative_args=("--speculative-algorithm", "DSPARK", *args))
    began = time.monotonic()
    with pytest.raises(ServerError) as info:
        start(spec, log_dir=log_dir)
    assert time.monotonic() - began < REFUSAL_WITHIN_S
    message = str(info.value)
    assert "exited with code 1" in message and "\n" not in message
    log = (log_dir / f"server-{port}.log").read_text()
    assert log.count("sgl-dspark: error: ") == 1 and "Traceback" not in log
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(port) in (p.info["cmdline"] or [])]
    return message


def test_an_invalid_knob_is_refused(default_model_path, drafters, tmp_path):
    message = refusal(default_model_path, ("--speculative-draft-model-path", drafters["fits"],
                                           "--speculative-dspark-max-window", "0"), tmp_path)
    assert "sgl-dspark: error: DSpark config: max_window=0 is invalid" in message


def test_a_missing_drafter_is_refused(default_model_path, tmp_path):
    missing = tmp_path / "no-drafter"
    message = refusal(default_model_path, ("--speculative-draft-model-path", str(missing)), tmp_path)
    assert f"sgl-dspark: error: --speculative-draft-model-path {missing}: no such directory" in message


@pytest.mark.parametrize("drafter, cause", [
    ("hidden", "hidden_size: drafter has 32, target has 576"),
    ("vocab", "vocab_size: drafter vocabulary has 32000 tokens, target has 49152"),
])
def test_an_incompatible_drafter_is_refused(default_model_path, drafters, tmp_path, drafter, cause):
    message = refusal(default_model_path, ("--speculative-draft-model-path", drafters[drafter]), tmp_path)
    assert "sgl-dspark: error: --speculative-draft-model-path" in message
    assert f"does not fit the target model: {cause}" in message
