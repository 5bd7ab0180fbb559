"""The seed article's offline API (sgl_dspark.engine): its names map onto DSpark knobs as documented, only what the
user set is passed on, bad arguments fail with one line naming the field, and the output record reads meta_info.
Starts no engine: the wiring test swaps a recording fake in for `sglang.Engine`."""

import json
import os
import subprocess
import sys
import types

import pytest

from sgl_dspark.config import config_from_flags, load_config
from sgl_dspark.drafter.checkpoint import CONFIG_FILE
from sgl_dspark.engine import DSparkConfig, DSparkEngine, DSparkOutput, engine_kwargs, output_of
from sgl_dspark.tools import launch
from sgl_dspark.tools.models import SHIPPED_DRAFTER

ARTICLE = {"draft_length": 16, "confidence_threshold": 0.7, "use_hierarchical_verify": True, "hardware_aware": True}
CPU_HOST = {"device": "cpu", "sleep_on_idle": True, "skip_server_warmup": True, "dtype": "float32"}
BASE = {"model_path": "M", "speculative_algorithm": "DSPARK", "speculative_draft_model_path": "D"}


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch):
    """Every test sees a host without CUDA (the CPU flags), whatever this machine has."""
    monkeypatch.setattr(launch, "has_cuda", lambda: False)


def dspark_kwargs(config: DSparkConfig) -> dict:
    return {k: v for k, v in engine_kwargs(config, "D").items() if k.startswith("speculative_dspark_")}


def test_public_names_import_without_sglang():
    code = ("import sys; from sgl_dspark import DSparkEngine, DSparkConfig, DSparkOutput; "
            "assert 'sglang' not in sys.modules, 'sglang imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_article_example_maps_onto_knobs():
    assert engine_kwargs(DSparkConfig("M", **ARTICLE), "D") == {**BASE, **CPU_HOST,
        "speculative_dspark_max_window": 16, "speculative_dspark_survival_threshold": 0.7,
        "speculative_dspark_tree_width": 3, "speculative_dspark_max_tree_nodes": 16,
        "speculative_dspark_branch_threshold": 0.6, "speculative_dspark_budget": "prefix",
        "speculative_dspark_gate": True}  # fmt: skip


def test_unset_fields_pass_nothing():
    assert engine_kwargs(DSparkConfig("M"), "D") == {**BASE, **CPU_HOST}
    assert dspark_kwargs(DSparkConfig("M", draft_length=4)) == {"speculative_dspark_max_window": 4}


def test_hierarchical_verify_is_the_tree_preset_and_false_is_a_chain():
    tree = config_from_flags(dspark_kwargs(DSparkConfig("M", use_hierarchical_verify=True)))
    preset = load_config("tree")
    assert (tree.tree_width, tree.max_tree_nodes, tree.branch_threshold) == (3, 16, 0.6)
    assert tree == preset
    assert dspark_kwargs(DSparkConfig("M", use_hierarchical_verify=False)) == {"speculative_dspark_tree_width": 1}
    assert config_from_flags(dspark_kwargs(DSparkConfig("M", use_hierarchical_verify=False))).is_chain


@pytest.mark.parametrize("hardware_aware, budget", [(True, "prefix"), (False, "off")])
def test_hardware_aware_is_the_verify_budget_and_the_gate(hardware_aware, budget):
    assert dspark_kwargs(DSparkConfig("M", hardware_aware=hardware_aware)) == {
        "speculative_dspark_budget": budget, "speculative_dspark_gate": hardware_aware}
    refined = DSparkConfig("M", hardware_aware=False, knobs={"gate": True})  # knobs refine what a field set
    assert dspark_kwargs(refined)["speculative_dspark_gate"] is True


def test_knobs_refine_the_article_fields_and_may_name_a_preset():
    config = DSparkConfig("M", draft_length=32, use_hierarchical_verify=True, knobs={"max_tree_nodes": 64})
    assert config_from_flags(dspark_kwargs(config)).max_tree_nodes == 64
    assert dspark_kwargs(DSparkConfig("M", knobs={"preset": "lagged", "lookup": False})) == {
        "speculative_dspark_preset": "lagged", "speculative_dspark_lookup": False}


def test_the_engine_and_the_launched_servers_get_one_set_of_cpu_settings():
    assert launch.device_args() == ("--device", "cpu", "--sleep-on-idle", "--skip-server-warmup")
    assert engine_kwargs(DSparkConfig("M"), "D") == {**BASE, **CPU_HOST}


def test_host_defaults_and_explicit_device(monkeypatch):
    monkeypatch.setattr(launch, "has_cuda", lambda: True)
    assert engine_kwargs(DSparkConfig("M"), "D") == {**BASE, "dtype": "float32"}
    kwargs = engine_kwargs(DSparkConfig("M", device="cuda", dtype="bfloat16", engine_args={"mem_fraction_static": 0.5}),
                           "D")
    assert kwargs == {**BASE, "device": "cuda", "dtype": "bfloat16", "mem_fraction_static": 0.5}


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_length": 0}, "DSparkConfig: draft_length -> max_window=0 is invalid; allowed: null or an integer >= 1"),
    ({"draft_length": 2.5}, "DSparkConfig: draft_length -> max_window=2.5 is invalid"),
    ({"confidence_threshold": 1.5}, "DSparkConfig: confidence_threshold -> survival_threshold=1.5 is invalid; "
                                    "allowed: a number in [0, 1]"),
    ({"use_hierarchical_verify": "yes"}, "DSparkConfig: use_hierarchical_verify='yes' is invalid; "
                                         "allowed: None | True | False"),
    ({"hardware_aware": 1}, "DSparkConfig: hardware_aware=1 is invalid"),
    ({"draft_length": 32, "use_hierarchical_verify": True}, "max_tree_nodes=16 is invalid; allowed: null or an "
                                                            "integer >= max_window=32"),
    ({"draft_length": 4, "knobs": {"max_window": 3}}, "DSparkConfig: draft_length and knobs['max_window'] set the "
                                                      "same knob"),
    ({"knobs": {"tree_width": 0}}, "tree_width=0 is invalid; allowed: an integer >= 1"),
    ({"knobs": {"bogus": 1}}, "unknown knob 'bogus'"),
    ({"knobs": {"preset": "nope"}}, "preset 'nope' not found"),
    ({"engine_args": {"speculative_algorithm": "EAGLE"}}, "engine_args['speculative_algorithm'] is set by"),
    ({"engine_args": {"speculative_dspark_gate": False}}, "engine_args['speculative_dspark_gate'] is set by"),
])
def test_bad_arguments_fail_at_construction_with_one_line(kwargs, message):
    with pytest.raises(ValueError) as caught:
        DSparkConfig("M", **kwargs)
    text = str(caught.value)
    assert message in text and "\n" not in text and text.startswith("DSparkConfig: ")


def test_bad_model_path():
    with pytest.raises(ValueError, match="model_path=''"):
        DSparkConfig("")


def test_config_is_frozen():
    config = DSparkConfig("M", knobs={"lookup": False})
    with pytest.raises(AttributeError):
        config.draft_length = 3
    with pytest.raises(TypeError):
        config.knobs["lookup"] = True


META = {"completion_tokens": 8, "spec_verify_ct": 4, "spec_accept_length": 2.0, "spec_mean_draft_length": 5.5,
        "spec_accept_rate": 0.25, "spec_num_correct_drafts": 4, "spec_num_proposed_drafts": 16}


def test_output_reads_the_figures_from_meta_info():
    out = output_of({"text": "ab", "output_ids": [1, 2, 3, 4, 5, 6, 7, 8], "meta_info": META}, wall_s=2.0)
    assert out == DSparkOutput("ab", [1, 2, 3, 4, 5, 6, 7, 8], tokens_per_second=4.0, avg_draft_length=5.5,
                               acceptance_rate=0.25, accept_length=2.0, meta_info=META)


def test_output_without_a_verify_step_reads_as_plain_decoding():
    out = output_of({"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}}, wall_s=0.5)
    assert (out.tokens_per_second, out.avg_draft_length, out.acceptance_rate, out.accept_length) == (2.0, 0, 0, 1)


class FakeEngine:
    """Records sglang.Engine's keyword arguments and answers each prompt with META."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        FakeEngine.made.append(kwargs)
        self.calls: list[tuple] = []
        self.closed = False

    def generate(self, prompt, sampling_params):
        self.calls.append((prompt, sampling_params))
        reply = {"text": "ab", "output_ids": list(range(8)), "meta_info": META}
        return reply if isinstance(prompt, str) else [reply] * len(prompt)

    def shutdown(self):
        self.closed = True


@pytest.fixture
def fake_sglang(monkeypatch):
    for name in launch.CPU_ENV:  # the engine sets these on a CPU host; restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    FakeEngine.made.clear()
    return FakeEngine


@pytest.fixture
def drafter_16(tmp_path) -> str:
    """A drafter folder whose config drafts 16 positions (the article's draft_length); no weights are needed."""
    config = json.loads((SHIPPED_DRAFTER / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**config, "block_size": 16}))
    return str(tmp_path)


def test_engine_wires_the_config_into_sglang_engine(fake_sglang, drafter_16):
    with DSparkEngine(DSparkConfig("M", draft_model_path=drafter_16, **ARTICLE)) as engine:
        assert fake_sglang.made == [engine_kwargs(engine.config, drafter_16)]
        assert all(os.environ[k] == v for k, v in launch.CPU_ENV.items())
        out = engine.generate("p", max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3)
        many = engine.generate(["p", "q"])
        inner = engine._engine
    assert inner.calls == [("p", {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3}),
                           (["p", "q"], {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0})]
    assert isinstance(out, DSparkOutput) and out.tokens_per_second > 0 and out.accept_length == 2.0
    assert len(many) == 2 and all(isinstance(o, DSparkOutput) for o in many)
    assert inner.closed


def test_a_draft_length_past_the_drafters_gamma_fails_before_sglang_starts(fake_sglang):
    with pytest.raises(ValueError) as caught:
        DSparkEngine(DSparkConfig("M", draft_model_path=str(SHIPPED_DRAFTER), **ARTICLE))
    text = str(caught.value)
    assert text.startswith("DSparkConfig: draft_length=16") and "exceed the drafter's gamma 7" in text
    assert "\n" not in text and fake_sglang.made == []
